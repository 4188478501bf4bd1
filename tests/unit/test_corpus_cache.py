"""The corpus cache: a corpus is read and split once per machine, then mapped by every stage of every peer.

    pytest tests/unit/test_corpus_cache.py -q
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from dilocox_p2p.config import DataConfig
from dilocox_p2p.corpus_cache import cache_root, load_or_build, manifest_key
from dilocox_p2p.data import load_corpus

pytestmark = pytest.mark.unit

SEQ = 16


def _corpus_dir(folder: Path, n: int = 30) -> Path:
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"f{i:02d}.txt").write_text(f"<file {i}>" * 30)
    return folder


def _load(folder: Path, cache: Path | str):
    return load_corpus(DataConfig(paths=(str(folder),), cache_dir=str(cache)), SEQ)


def _bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


def test_a_second_load_maps_the_same_split_from_the_cache(tmp_path, caplog):
    folder = _corpus_dir(tmp_path / "text")
    caplog.set_level("INFO", logger="dilocox_p2p.data")
    first = _load(folder, tmp_path / "cache")
    second = _load(folder, tmp_path / "cache")
    assert "(read)" in caplog.records[0].message and "(cached)" in caplog.records[1].message
    assert _bytes(first.train) == _bytes(second.train) and _bytes(first.val) == _bytes(second.val)
    assert first.content == second.content and len(first.content) == 64
    direct = _load(folder, "off")  # the cache changes nothing about the split
    assert _bytes(direct.train) == _bytes(second.train) and direct.content == second.content


def test_a_changed_file_is_read_again_and_the_same_files_elsewhere_share_the_content_hash(tmp_path):
    folder = _corpus_dir(tmp_path / "text")
    before = _load(folder, tmp_path / "cache")
    (folder / "f03.txt").write_text("changed " * 40)
    after = _load(folder, tmp_path / "cache")
    assert after.content != before.content and b"changed" in _bytes(after.train) + _bytes(after.val)
    copy = _corpus_dir(tmp_path / "elsewhere" / "text")
    for path in folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    assert _load(copy, tmp_path / "cache").content == after.content
    assert len([p for p in (tmp_path / "cache" / "corpus").iterdir() if p.is_dir() and not p.name.startswith(".")]) == 3
    # 3 directories: manifests, and one entry per distinct content


def test_a_damaged_entry_is_built_again_and_an_unusable_cache_only_costs_a_direct_read(tmp_path, caplog):
    folder = _corpus_dir(tmp_path / "text")
    good = _load(folder, tmp_path / "cache")
    want = _bytes(good.train)
    damaged = tmp_path / "cache" / "corpus" / good.content / "train.u8"
    (damaged.parent / "short").write_bytes(b"short")
    os.replace(damaged.parent / "short", damaged)  # not in place: `good` still maps the old file
    again = _load(folder, tmp_path / "cache")
    assert _bytes(again.train) == want == _bytes(good.train)
    assert _load(folder, tmp_path / "cache").train.numel() == len(want) and damaged.stat().st_size == len(want)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory should be")
    caplog.set_level("WARNING")
    assert _bytes(_load(folder, blocked).train) == want
    assert "unusable" in caplog.text and "data.cache_dir" in caplog.text


def test_stages_loading_at_once_build_the_entry_once(tmp_path):
    builds = []

    def build():
        builds.append(1)
        return bytearray(b"train bytes" * 100), bytearray(b"val bytes" * 10)

    results = []
    threads = [threading.Thread(target=lambda: results.append(load_or_build(tmp_path, "k" * 64, build))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(builds) == 1 and len({r.content for r in results}) == 1 and sum(r.hit for r in results) == 3


def test_the_manifest_changes_with_a_files_size_or_time_and_with_the_split(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello")
    files = [("a.txt", path)]
    key = manifest_key(files, split="by-path 0.02")
    assert manifest_key(files, split="by-path 0.05") != key
    os.utime(path, ns=(1, 1))
    assert manifest_key(files, split="by-path 0.02") != key


def test_the_cache_directory_follows_the_setting_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DILOCOX_CACHE_DIR", str(tmp_path / "env"))
    assert cache_root("off") is None
    assert cache_root(str(tmp_path / "set")) == tmp_path / "set"
    assert cache_root("") == tmp_path / "env"
    monkeypatch.delenv("DILOCOX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root("") == tmp_path / "xdg" / "dilocox-p2p"
