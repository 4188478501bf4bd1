"""Data: the stdlib corpus, user files, the by-path validation split and the batch sampler.

Run: python -m pytest tests/unit/test_data.py -q
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from dilocox_p2p.config import DataConfig
from dilocox_p2p.data import BatchSampler, load_corpus, stdlib_files, val_batches
from dilocox_p2p.errors import DataError

pytestmark = pytest.mark.unit

SEQ = 16


def _make_files(folder: Path, n: int, *, size: int = 200, suffix: str = ".txt") -> list[Path]:
    """n files, each filled with its own marker so its bytes can be found in a split."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"{folder.name}-{i:03d}{suffix}"
        marker = f"<{path.name}>"
        path.write_text((marker * (size // len(marker) + 1))[:size])
        paths.append(path)
    return paths


def _b(t: torch.Tensor) -> bytes:
    return t.to(torch.uint8).numpy().tobytes()


def _in_val(corpus, path: Path) -> bool:
    marker = f"<{path.name}>".encode()
    in_val, in_train = marker in _b(corpus.val), marker in _b(corpus.train)
    assert in_val != in_train, f"{path.name} is in both splits or in neither"
    return in_val


# ----- the embedded corpus ---------------------------------------------------------------


def test_stdlib_files_finds_many_python_files_in_a_fixed_order_without_site_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    named = stdlib_files()
    names, files = [n for n, _ in named], [f for _, f in named]
    assert len(files) > 500
    assert files == sorted(files)
    assert all(f.suffix == ".py" and f.is_relative_to(root) for f in files)
    assert names == [str(f.relative_to(root)) for f in files]  # the split key is the path inside the stdlib
    assert not [f for f in files if {"site-packages", "dist-packages"} & set(f.parts)]
    assert root / "os.py" in files


# ----- user files and the split ----------------------------------------------------------


def test_a_directory_is_read_recursively_and_split_into_whole_files(tmp_path):
    paths = _make_files(tmp_path / "top", 30) + _make_files(tmp_path / "top" / "nested", 10)
    corpus = load_corpus(DataConfig(paths=(str(tmp_path / "top"),), val_fraction=0.3), SEQ)
    assert corpus.n_files == 40
    assert len(corpus.train) + len(corpus.val) == 40 * 200
    n_val = sum(_in_val(corpus, p) for p in paths)
    assert 0 < n_val < 40
    assert len(corpus.val) == n_val * 200
    assert corpus.train.dtype == torch.uint8


def test_the_split_is_deterministic(tmp_path):
    _make_files(tmp_path, 30)
    cfg = DataConfig(paths=(str(tmp_path),), val_fraction=0.3)
    first, second = load_corpus(cfg, SEQ), load_corpus(cfg, SEQ)
    assert torch.equal(first.train, second.train)
    assert torch.equal(first.val, second.val)


def test_a_files_split_depends_on_its_path_not_on_the_other_files(tmp_path):
    paths = _make_files(tmp_path / "all", 40)
    full = load_corpus(DataConfig(paths=(str(tmp_path / "all"),), val_fraction=0.4), SEQ)
    val = [p for p in paths if _in_val(full, p)]
    train = [p for p in paths if p not in val]
    assert val and train
    subset = val[: max(1, len(val) // 2)] + train[::3]
    part = load_corpus(DataConfig(paths=tuple(map(str, subset)), val_fraction=0.4), SEQ)
    assert part.n_files == len(subset)
    for path in subset:
        assert _in_val(part, path) == (path in val), path.name


def test_the_same_files_in_another_directory_are_split_the_same_way(tmp_path):
    # The module promises a split by relative path, "the same on every machine that has the
    # same files": two peers keeping one corpus under different home directories must agree.
    alice = _make_files(tmp_path / "alice" / "corpus", 40)
    bob = _make_files(tmp_path / "bob" / "elsewhere" / "corpus", 40)
    cfg_a = DataConfig(paths=(str(tmp_path / "alice" / "corpus"),), val_fraction=0.4)
    cfg_b = DataConfig(paths=(str(tmp_path / "bob" / "elsewhere" / "corpus"),), val_fraction=0.4)
    split_a = [_in_val(load_corpus(cfg_a, SEQ), p) for p in alice]
    split_b = [_in_val(load_corpus(cfg_b, SEQ), p) for p in bob]
    assert split_a == split_b


def test_a_glob_selects_only_matching_files(tmp_path):
    _make_files(tmp_path, 12, suffix=".txt")
    _make_files(tmp_path / "other", 3, suffix=".md")
    corpus = load_corpus(DataConfig(paths=(str(tmp_path / "*.txt"),)), SEQ)
    assert corpus.n_files == 12
    assert b".md>" not in _b(corpus.train) + _b(corpus.val)


def test_a_recursive_glob_reaches_nested_files(tmp_path):
    _make_files(tmp_path / "a" / "b", 4, size=1000, suffix=".md")
    _make_files(tmp_path, 4, suffix=".txt")
    corpus = load_corpus(DataConfig(paths=(str(tmp_path / "**" / "*.md"),)), SEQ)
    assert corpus.n_files == 4


def test_overlapping_specs_count_each_file_once(tmp_path):
    paths = _make_files(tmp_path, 6)
    corpus = load_corpus(DataConfig(paths=(str(tmp_path), str(paths[0]), str(tmp_path / "*.txt"))), SEQ)
    assert corpus.n_files == 6
    assert len(corpus.train) + len(corpus.val) == 6 * 200


def test_a_single_file_is_split_into_head_for_training_and_tail_for_validation_whatever_its_name(tmp_path):
    # Whether the one file's path hashes into the validation split must not matter: with
    # too few files the tail is held out. Thirty names at val_fraction 0.45 make it
    # all but certain that some of them hash into validation.
    for i in range(30):
        path = tmp_path / f"single{i}.txt"
        blob = bytes(range(256)) * 4
        path.write_bytes(blob)
        corpus = load_corpus(DataConfig(paths=(str(path),), val_fraction=0.45), SEQ)
        cut = int(len(blob) * (1 - 0.45))
        assert corpus.n_files == 1
        assert _b(corpus.train) == blob[:cut], path.name
        assert _b(corpus.val) == blob[cut:], path.name


def test_a_missing_path_is_a_data_error_naming_it(tmp_path):
    missing = tmp_path / "nothing-here"
    with pytest.raises(DataError, match=rf"--data {missing}: no such file"):
        load_corpus(DataConfig(paths=(str(missing),)), SEQ)


def test_a_glob_matching_nothing_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=r"\*\.zzz"):
        load_corpus(DataConfig(paths=(str(tmp_path / "*.zzz"),)), SEQ)


def test_a_corpus_too_small_for_seq_len_is_a_data_error_saying_how_small(tmp_path):
    _make_files(tmp_path, 3, size=100)
    with pytest.raises(DataError, match=r"too small.*seq_len 512"):
        load_corpus(DataConfig(paths=(str(tmp_path),)), 512)


# ----- the sampler -----------------------------------------------------------------------


def _ramp(n: int) -> torch.Tensor:
    """Bytes whose every next byte is the previous + 1 (mod 251), so windows show their shift."""
    return (torch.arange(n) % 251).to(torch.uint8)


def test_targets_are_the_inputs_shifted_by_one_byte():
    inputs, targets = BatchSampler(_ramp(5000), SEQ, 8, seed=0).next()
    assert inputs.shape == targets.shape == (8, SEQ)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets, (inputs + 1) % 251)


def test_batches_are_windows_of_the_data():
    data = torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    inputs, targets = BatchSampler(data, SEQ, 4, seed=1).next()
    text = _b(data)
    for row_in, row_t in zip(inputs, targets):
        window = _b(row_in) + _b(row_t[-1:])
        assert window in text


def test_the_same_seed_gives_the_same_batches_and_another_seed_does_not():
    data = _ramp(5000)
    a, b, c = (BatchSampler(data, SEQ, 8, seed=s) for s in (5, 5, 6))
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = a.next(), b.next(), c.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)


def test_a_sampler_resumes_mid_stream_from_its_state():
    data = _ramp(5000)
    original = BatchSampler(data, SEQ, 8, seed=3)
    original.next()
    original.next()
    state = original.state().clone()
    expected = [original.next() for _ in range(3)]
    resumed = BatchSampler(data, SEQ, 8, seed=999)
    resumed.load_state(state)
    for (x, y), (xe, ye) in zip((resumed.next() for _ in range(3)), expected):
        assert torch.equal(x, xe) and torch.equal(y, ye)


def test_the_sampler_draws_every_window_including_the_last():
    # seq_len + 3 bytes hold exactly three windows of seq_len + 1 bytes: starts 0, 1, 2.
    data = _ramp(SEQ + 3)
    sampler = BatchSampler(data, SEQ, 64, seed=0)
    starts = {int(row[0]) for _ in range(4) for row in sampler.next()[0]}
    assert starts == {0, 1, 2}


def test_the_sampler_accepts_a_corpus_exactly_one_window_long():
    # load_corpus accepts seq_len + 1 bytes of each split, so the sampler must draw from it.
    data = _ramp(SEQ + 1)
    inputs, targets = BatchSampler(data, SEQ, 2, seed=0).next()
    assert torch.equal(inputs[0], data[:-1].long())
    assert torch.equal(targets[0], data[1:].long())


def test_validation_batches_are_the_same_every_time(tmp_path):
    _make_files(tmp_path, 30)
    corpus = load_corpus(DataConfig(paths=(str(tmp_path),), val_fraction=0.3), SEQ)
    first, second = val_batches(corpus, SEQ, 4, 3), val_batches(corpus, SEQ, 4, 3)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert _b(first[0][0][0]) in _b(corpus.val)
