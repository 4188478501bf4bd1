"""Training text: the embedded default corpus (this interpreter's standard library sources)
or the user's files, split into train/validation by file, sampled per peer from a seed.
The split bytes are cached once per machine and memory-mapped (corpus_cache.py).

The split is decided by a hash of each file's relative path, so it is the same on every
machine that has the same files. Each peer draws random windows of `seq_len + 1` bytes
from the train split with its own generator; the generator state is the data position
and goes into checkpoints.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DataConfig
from .corpus_cache import cache_root, load_or_build, manifest_key
from .errors import DataError

__all__ = ["BatchSampler", "Corpus", "load_corpus", "stdlib_files", "val_batches"]

logger = logging.getLogger(__name__)

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative name, path) of the running interpreter's standard library .py files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # never descends into site-packages
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return [(str(p.relative_to(root)), p) for p in sorted(files)]


def _glob_base(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard."""
    parts = Path(pattern).parts
    cut = next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts) - 1)
    return Path(*parts[:cut]) if cut else Path(".")


def _user_files(specs: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(name, path) of the user's files; names are relative to the --data argument, so two peers
    holding the same corpus in different directories split it the same way."""
    files: dict[Path, str] = {}
    for spec in specs:
        path = Path(spec).expanduser()
        if path.is_dir():
            found = [(p, p.relative_to(path)) for p in path.rglob("*") if p.is_file()]
        elif path.is_file():
            found = [(path, Path(path.name))]
        else:
            base = _glob_base(str(path))
            found = [(Path(p), Path(p).relative_to(base)) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        if not found:
            raise DataError(f"--data {spec}: no such file, directory or matching glob")
        for p, name in found:
            files.setdefault(p.resolve(), str(name))
    return sorted(((name, p) for p, name in files.items()), key=lambda item: (item[0], str(item[1])))


def _is_val(name: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # uint8, all train files concatenated
    val: torch.Tensor  # uint8, all validation files concatenated
    n_files: int
    source: str
    content: str  # SHA-256 of the split bytes: peers holding the same corpus hold the same hash


def load_corpus(cfg: DataConfig, seq_len: int) -> Corpus:
    """The corpus named by the config, split into train and validation bytes: mapped from the machine's
    corpus cache (corpus_cache.py) when these files were prepared before, read and split otherwise."""
    files = _user_files(cfg.paths) if cfg.paths else stdlib_files()
    source = ", ".join(cfg.paths) if cfg.paths else f"python stdlib at {sysconfig.get_paths()['stdlib']}"
    key = manifest_key(files, split=f"by-path {cfg.val_fraction!r}")
    split = load_or_build(cache_root(cfg.cache_dir), key, lambda: _read_split(files, cfg.val_fraction))
    train, val = split.train, split.val
    need = seq_len + 1
    if len(train) < need or len(val) < need:
        raise DataError(
            f"corpus {source} is too small: {len(train)} train / {len(val)} validation bytes, "
            f"need at least {need} of each (seq_len {seq_len}); add more text or lower model.seq_len"
        )
    logger.info("corpus: %s, %d files, %.1f MB train, %.1f MB val, sha256 %s (%s)", source, len(files), len(train) / 1e6,
                len(val) / 1e6, split.content[:12], "cached" if split.hit else "read")  # fmt: skip
    return Corpus(train=train, val=val, n_files=len(files), source=source, content=split.content)


def _read_split(files: list[tuple[str, Path]], val_fraction: float) -> tuple[bytearray, bytearray]:
    """Every file's bytes, each file whole in the train or the validation split (by a hash of its name)."""
    train, val = bytearray(), bytearray()
    for name, path in files:
        try:
            blob = path.read_bytes()
        except OSError as e:
            logger.warning("skipping unreadable file %s: %s", path, e.strerror)
            continue
        target = val if _is_val(name, val_fraction) else train
        target += blob
    if not val or not train:  # too few files to split by file: hold out the tail of the text instead
        text = train + val
        cut = int(len(text) * (1 - val_fraction))
        train, val = text[:cut], text[cut:]
    return train, val


class BatchSampler:
    """Random (input, target) windows from a byte tensor, reproducible from a seed."""

    def __init__(self, data: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch: inputs (B, T) and targets (B, T), int64, contiguous (not views into (B, T + 1) rows)."""
        starts = torch.randint(0, len(self.data) - self.seq_len, (self.batch_size,), generator=self.generator)
        rows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def val_batches(corpus: Corpus, seq_len: int, batch_size: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of validation batches, identical on every peer and every round."""
    sampler = BatchSampler(corpus.val, seq_len, batch_size, seed=1234)
    return [sampler.next() for _ in range(n)]
