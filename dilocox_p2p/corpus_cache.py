"""The prepared corpus, cached once per machine: train and validation bytes as flat files, memory-mapped.

Reading and splitting the default corpus (about 1,800 files) costs a stage more than half a
second of CPU at every start, and every peer on a machine would hold its own copy. The cache
keeps the split bytes in files that every stage of every peer maps, so a warm start reads
nothing and the pages are shared:

    CACHE/corpus/manifests/{key}.json      key: SHA-256 of the files' names, sizes and mtimes and
                                           the split; holds the content hash
    CACHE/corpus/{content}/train.u8 val.u8 content: SHA-256 of the split bytes (identical corpora
                                           share one entry)

CACHE is `data.cache_dir`, or $DILOCOX_CACHE_DIR, or $XDG_CACHE_HOME/dilocox-p2p (~/.cache).
Entries are written to a temporary name and renamed, under a file lock, so concurrent stages
build an entry once and nobody maps a half-written one. The cache is never worth failing a
run for: any error is logged and the files are read directly.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CachedSplit", "cache_root", "load_or_build", "manifest_key"]

logger = logging.getLogger(__name__)

FORMAT = 1
OFF = "off"


@dataclass(frozen=True)
class CachedSplit:
    train: torch.Tensor  # uint8
    val: torch.Tensor  # uint8
    content: str  # SHA-256 of the split (train bytes, then val bytes)
    hit: bool  # read from the cache (False: built now)


def cache_root(setting: str) -> Path | None:
    """The cache directory `data.cache_dir` names ("" = the default, "off" = none)."""
    if setting == OFF:
        return None
    if setting:
        return Path(setting).expanduser()
    if os.environ.get("DILOCOX_CACHE_DIR"):
        return Path(os.environ["DILOCOX_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "dilocox-p2p"


def manifest_key(files: Sequence[tuple[str, Path]], split: str) -> str:
    """What decides the split bytes without reading them: each file's name, size and mtime, and the split."""
    digest = hashlib.sha256(f"{FORMAT}\n{split}\n".encode())
    for name, path in files:
        try:
            st = path.stat()
            digest.update(f"{name}\0{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(f"{name}\0{path}\0missing\n".encode())
    return digest.hexdigest()


def load_or_build(root: Path | None, key: str, build: Callable[[], tuple[bytearray, bytearray]]) -> CachedSplit:
    """The split of manifest `key`: mapped from the cache under `root`, or `build()` (train and val bytes),
    then stored there for next time."""
    if root is None:
        return _built(*build())
    folder = root / "corpus"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second stage waits for the first one's entry, then maps it
            found = _lookup(folder, key)
            if found is not None:
                return found
            built = _built(*build())
            _store(folder, key, built)
            return _lookup(folder, key, hit=False) or built
    except OSError as e:
        logger.warning("corpus cache %s unusable (%s): reading the files directly; set data.cache_dir to another "
                       "directory, or to %r", folder, e, OFF)  # fmt: skip
        return _built(*build())


def _built(train: bytearray, val: bytearray) -> CachedSplit:
    digest = hashlib.sha256(train)
    digest.update(b"\0val\0")
    digest.update(val)
    return CachedSplit(_as_tensor(train), _as_tensor(val), digest.hexdigest(), hit=False)


def _as_tensor(blob: bytearray) -> torch.Tensor:
    return torch.frombuffer(blob, dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)


def _lookup(folder: Path, key: str, *, hit: bool = True) -> CachedSplit | None:
    try:
        manifest = json.loads((folder / "manifests" / f"{key}.json").read_text())
        content, sizes = manifest["content"], (int(manifest["train_bytes"]), int(manifest["val_bytes"]))
    except (OSError, ValueError, KeyError) as e:
        if not isinstance(e, FileNotFoundError):
            logger.info("corpus cache manifest %s unreadable (%r): building it again", key[:12], e)
        return None
    mapped = _lookup_entry(folder / content, *sizes)
    return None if mapped is None else CachedSplit(*mapped, content, hit=hit)


def _lookup_entry(entry: Path, train_bytes: int, val_bytes: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    try:
        return _map(entry / "train.u8", train_bytes), _map(entry / "val.u8", val_bytes)
    except (OSError, ValueError, RuntimeError) as e:
        if not isinstance(e, FileNotFoundError):
            logger.info("corpus cache entry %s damaged (%s): building it again", entry.name[:12], e)
        return None


def _map(path: Path, size: int) -> torch.Tensor:
    if path.stat().st_size != size:
        raise ValueError(f"{path} holds {path.stat().st_size} bytes, its manifest says {size}")
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def _store(folder: Path, key: str, split: CachedSplit) -> None:
    """Write the entry under a temporary name and rename it into place. Files of an entry are never written
    again: a damaged entry is renamed aside first, so that a stage mapping it keeps its pages."""
    train, val, content = split.train, split.val, split.content
    entry = folder / content
    if entry.is_dir() and _lookup_entry(entry, len(train), len(val)) is None:
        aside = Path(tempfile.mkdtemp(prefix=".damaged-", dir=folder))
        os.rename(entry, aside / "entry")
        shutil.rmtree(aside, ignore_errors=True)
    if not entry.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".entry-", dir=folder))
        try:
            for part, tensor in (("train", train), ("val", val)):
                with open(tmp / f"{part}.u8", "wb") as f:
                    f.write(tensor.numpy().tobytes())
            os.rename(tmp, entry)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not entry.is_dir():
                raise
    manifests = folder / "manifests"
    manifests.mkdir(exist_ok=True)
    manifest = {"format": FORMAT, "content": content, "train_bytes": len(train), "val_bytes": len(val)}
    tmp_manifest = manifests / f".{key}.tmp"
    tmp_manifest.write_text(json.dumps(manifest))
    os.replace(tmp_manifest, manifests / f"{key}.json")
