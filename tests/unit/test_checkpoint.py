"""Checkpoints: round trip, atomic writes, pruning, the newest round all stages share.

Run: python -m pytest tests/unit/test_checkpoint.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from dilocox_p2p.checkpoint import latest_common_round, load_checkpoint, save_checkpoint
from dilocox_p2p.errors import CheckpointError

pytestmark = pytest.mark.unit


def _state(value: float = 1.0) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "config_hash": "ab" * 32,
        "outer": {
            "theta_g": [torch.full((2, 3), value), torch.arange(4.0)],
            "momentum": [torch.zeros(2, 3), torch.ones(4)],
            "pending": {"round": 4, "tensors": [torch.ones(2, 3)], "group_size": 3},
        },
        "data": gen.get_state(),
        "rng": torch.get_rng_state(),
        "tokens": 123_456,
    }


def _files(run_dir, stage):
    return sorted(p.name for p in (run_dir / "checkpoints" / f"stage{stage}").iterdir())


def test_save_then_load_returns_the_same_state(tmp_path):
    state = _state(2.5)
    path = save_checkpoint(tmp_path, 1, 5, state)
    assert path == tmp_path / "checkpoints" / "stage1" / "round000005.pt"
    loaded = load_checkpoint(tmp_path, 1, 5)
    assert loaded["round"] == 5 and loaded["stage"] == 1
    assert loaded["tokens"] == 123_456
    assert loaded["config_hash"] == state["config_hash"]
    for a, b in zip(loaded["outer"]["theta_g"], state["outer"]["theta_g"]):
        assert torch.equal(a, b)
    assert loaded["outer"]["pending"]["round"] == 4
    assert torch.equal(loaded["outer"]["pending"]["tensors"][0], torch.ones(2, 3))
    assert torch.equal(loaded["data"], state["data"])
    assert torch.equal(loaded["rng"], state["rng"])


def test_a_loaded_generator_state_resumes_the_same_random_stream(tmp_path):
    gen = torch.Generator().manual_seed(11)
    torch.randint(0, 100, (5,), generator=gen)
    save_checkpoint(tmp_path, 0, 1, {"data": gen.get_state()})
    expected = torch.randint(0, 100, (5,), generator=gen)
    resumed = torch.Generator().manual_seed(0)
    resumed.set_state(load_checkpoint(tmp_path, 0, 1)["data"])
    assert torch.equal(torch.randint(0, 100, (5,), generator=resumed), expected)


def test_saving_leaves_no_temp_files_and_keeps_only_the_newest(tmp_path):
    for round in range(5):
        save_checkpoint(tmp_path, 0, round, _state(float(round)), keep=2)
    assert _files(tmp_path, 0) == ["round000003.pt", "round000004.pt"]
    assert load_checkpoint(tmp_path, 0, 4)["outer"]["theta_g"][0][0, 0].item() == 4.0


def test_keep_three_keeps_three(tmp_path):
    for round in (0, 2, 4, 6, 8):
        save_checkpoint(tmp_path, 0, round, {}, keep=3)
    assert _files(tmp_path, 0) == ["round000004.pt", "round000006.pt", "round000008.pt"]


def test_a_failed_save_leaves_the_previous_checkpoint_of_that_round_intact(tmp_path):
    save_checkpoint(tmp_path, 0, 3, _state(7.0))
    with pytest.raises(Exception):
        save_checkpoint(tmp_path, 0, 3, {"unpicklable": lambda: None})
    loaded = load_checkpoint(tmp_path, 0, 3)
    assert loaded["outer"]["theta_g"][0][0, 0].item() == 7.0


def test_latest_common_round_is_the_newest_round_every_stage_has(tmp_path):
    for round in (2, 3):
        save_checkpoint(tmp_path, 0, round, {}, keep=5)
    save_checkpoint(tmp_path, 1, 2, {}, keep=5)
    assert latest_common_round(tmp_path, 2) == 2
    assert latest_common_round(tmp_path, 1) == 3


def test_latest_common_round_is_none_without_checkpoints(tmp_path):
    assert latest_common_round(tmp_path, 2) is None
    assert latest_common_round(tmp_path / "never-created", 1) is None


def test_latest_common_round_is_none_when_one_stage_has_none(tmp_path):
    save_checkpoint(tmp_path, 0, 4, {})
    assert latest_common_round(tmp_path, 2) is None


def test_latest_common_round_ignores_temp_and_foreign_files(tmp_path):
    save_checkpoint(tmp_path, 0, 1, {})
    folder = tmp_path / "checkpoints" / "stage0"
    (folder / ".round000009.pt.tmp").write_bytes(b"half")
    (folder / "round9.pt").write_bytes(b"x")
    (folder / "notes.txt").write_text("hi")
    assert latest_common_round(tmp_path, 1) == 1


def test_a_corrupt_file_is_a_checkpoint_error_naming_it(tmp_path):
    path = save_checkpoint(tmp_path, 0, 3, _state())
    path.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(tmp_path, 0, 3)


def test_a_truncated_file_is_a_checkpoint_error_naming_it(tmp_path):
    path = save_checkpoint(tmp_path, 0, 3, _state())
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(tmp_path, 0, 3)


def test_a_missing_checkpoint_is_a_checkpoint_error_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"stage0/round000007\.pt is missing"):
        load_checkpoint(tmp_path, 0, 7)


def test_another_stages_checkpoint_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, 0, 3, _state())
    foreign = tmp_path / "checkpoints" / "stage1" / path.name
    foreign.parent.mkdir(parents=True)
    foreign.write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"not a stage-1 checkpoint"):
        load_checkpoint(tmp_path, 1, 3)


def test_a_temp_file_left_by_a_kill_mid_write_is_removed_by_the_next_save(tmp_path):
    save_checkpoint(tmp_path, 0, 1, _state())
    stale = tmp_path / "checkpoints" / "stage0" / ".round000002.pt.tmp"
    stale.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path, 0, 3, _state())
    assert not stale.exists()


def _config(tmp_path, **overrides):
    from dilocox_p2p.config import load_config

    return load_config(None, {"run.run_dir": str(tmp_path / "run"), "model.stages": 2, **overrides})


def test_a_run_that_crashed_writing_its_first_checkpoints_starts_afresh_but_another_run_is_never_touched(tmp_path):
    from dilocox_p2p.launch import prepare_run_dir

    cfg = _config(tmp_path)
    prepare_run_dir(cfg, resume=False)
    save_checkpoint(cfg.run.path, 0, 0, _state())  # stage 1 died before writing its own
    prepare_run_dir(cfg, resume=False)  # nothing to resume: the partial files go, the run starts again
    assert latest_common_round(cfg.run.path, 2) is None and not any((cfg.run.path / "checkpoints").rglob("*.pt"))

    save_checkpoint(cfg.run.path, 0, 0, _state())
    other = _config(tmp_path, **{"inner.lr": 0.123})  # another config in the same directory: refused, kept
    with pytest.raises(CheckpointError, match="already holds a run"):
        prepare_run_dir(other, resume=False)
    save_checkpoint(cfg.run.path, 1, 0, _state())
    with pytest.raises(CheckpointError, match="already holds a run"):  # a complete checkpoint: resume it
        prepare_run_dir(cfg, resume=False)
    assert latest_common_round(cfg.run.path, 2) == 0


def test_resuming_a_peer_that_averaged_with_others_without_initial_peers_warns_that_it_will_train_alone(tmp_path, caplog):
    from dilocox_p2p.config import load_config
    from dilocox_p2p.launch import _warn_if_alone_again
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [json.dumps({"round": t, "group_size": size}) for t, size in enumerate([None, 3, 3])]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    alone = load_config(overrides={"run.run_dir": str(run_dir)})
    peer = "/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWECBTr6v59UqZ1z4a9ZLPdpuBco1DEUzNKmK1xo6iPVjn"
    joined = load_config(overrides={"run.run_dir": str(run_dir), "swarm.initial_peers": [peer]})
    with caplog.at_level("WARNING"):
        _warn_if_alone_again(joined)
        assert not caplog.records
        _warn_if_alone_again(alone)
    assert "averaged in groups of 3, without --initial-peers" in caplog.text
    assert "pass --initial-peers with a live peer's or a bootstrap node's multiaddr" in caplog.text
