"""benchmarks/convergence.py, the quality lab: its runs are recorded as they go, resumed to the bit, never run twice.

    pytest tests/unit/test_convergence_benchmark.py -q
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks import convergence, quality_report
from benchmarks.netns.gpu import GpuSetting
from benchmarks.quality_store import RunKey, RunStore, StoreMismatch
from tests.helpers.artifacts import ROOT

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def gloo_group():
    """A one-process gloo group, as the benchmark's runs have (PipelineStage wants one)."""
    if dist.is_initialized():
        yield
        return
    with convergence._pipeline_group():
        yield


def _args(store=None, device="cpu") -> argparse.Namespace:
    return argparse.Namespace(preset="tiny", peers=2, rounds=4, inner_steps=2, batch_size=2, warmup=1, val_batches=1,
                              store=store, checkpoint_every=2, device=device)  # fmt: skip


class _Killed(Exception):
    pass


def _dies_after_recording(round_: int):
    """A RunStore whose run dies right after it recorded `round_` (a kill between two checkpoints)."""

    class Dying(RunStore):
        def record_round(self, key, row):
            super().record_round(key, row)
            if row.get("round") == round_:
                raise _Killed(f"killed after round {round_}")

    return Dying


@pytest.mark.parametrize("label", ["sync topk", "delayed lowrank", "streaming P2 fp4", "sync topk x3 muon"])
def test_a_run_killed_between_checkpoints_resumes_to_the_same_bits_as_one_run_straight_through(
    label, tmp_path, monkeypatch, gloo_group
):
    settings, [(lr, momentum), *_] = convergence.CONFIGS[label]
    if "outer.overlap_steps" in settings:  # streaming: tau within a fragment's H / P = 1 step here
        settings = {**settings, "outer.overlap_steps": 1}
    straight = convergence.run(label, settings, lr, momentum, _args())

    store = tmp_path / "store"
    with monkeypatch.context() as m:
        m.setattr(convergence, "RunStore", _dies_after_recording(2))  # the checkpoint holds rounds 0-1: 2 runs again
        with pytest.raises(_Killed):
            convergence.run(label, settings, lr, momentum, _args(store))
    key = RunKey(label, lr, momentum)
    assert (store / f"{key.stem}.pt").exists()
    assert [line.get("round") for line in RunStore(store, convergence.shape_of(_args(store))).lines(key)] == [
        None, 0, 1, 2]  # fmt: skip

    resumed = convergence.run(label, settings, lr, momentum, _args(store))

    assert resumed["val_curve"] == straight["val_curve"]  # every round's loss, to the last bit
    assert resumed["bytes_sent_per_peer"] == straight["bytes_sent_per_peer"]
    lines = RunStore(store, convergence.shape_of(_args(store))).lines(key)
    assert [line.get("round") for line in lines[1:-1]] == [0, 1, 2, 3]  # round 2 recorded once, after the resume
    assert lines[-1]["result"]["val_curve"] == straight["val_curve"]
    assert not (store / f"{key.stem}.pt").exists()  # a finished run keeps its record, not its checkpoint


def test_a_finished_run_is_read_back_not_run_again(tmp_path, gloo_group):
    settings, [(lr, momentum), *_] = convergence.CONFIGS["sync fp32"]
    store = tmp_path / "store"
    first = convergence.run("sync fp32", settings, lr, momentum, _args(store))
    record = store / f"{RunKey('sync fp32', lr, momentum).stem}.jsonl"
    before = record.read_text()

    again = convergence.run("sync fp32", settings, lr, momentum, _args(store))

    assert again == json.loads(json.dumps(first))
    assert record.read_text() == before


def test_a_store_of_another_shape_is_refused_and_says_what_differs(tmp_path):
    RunStore(tmp_path, convergence.shape_of(_args()))
    other = _args()
    other.rounds = 300

    with pytest.raises(StoreMismatch, match=r"another shape.*'rounds': \(4, 300\)"):
        RunStore(tmp_path, convergence.shape_of(other))


def test_a_gpu_run_is_never_compared_with_or_resumed_as_a_cpu_one(tmp_path):
    cpu, gpu = convergence.shape_of(_args()), convergence.shape_of(_args(device="cuda"))
    assert "device" not in cpu  # as every result written before --device: their shapes still match
    assert gpu == {**cpu, "device": "cuda"}
    RunStore(tmp_path / "store", cpu)
    with pytest.raises(StoreMismatch, match=r"'device': \(None, 'cuda'\)"):
        RunStore(tmp_path / "store", gpu)
    result = tmp_path / "cpu.json"
    result.write_text(json.dumps({"shape": cpu, "results": {"sync fp32": {"best": {}, "runs": []}}}))
    with pytest.raises(SystemExit, match="device cuda here, None there"):
        convergence.baseline_from(result, _args(device="cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda runs")
def test_the_lab_asked_for_a_gpu_where_there_is_none_says_so_before_any_run(tmp_path):
    out = subprocess.run([sys.executable, "benchmarks/convergence.py", "--device", "cuda", "--rounds", "1",
                          "--name", "no_gpu", "--store", str(tmp_path / "store"), "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--device cuda: " in out.stderr and "leave --device out" in out.stderr, out.stderr
    assert not (tmp_path / "store").exists() and not list(tmp_path.glob("*.json"))


def test_a_baseline_from_an_earlier_result_of_the_same_shape_is_taken_and_one_of_another_shape_refused(tmp_path):
    found = {"best": {"final_val": 2.0, "val_curve": [3.0, 2.0]}, "runs": []}
    result = tmp_path / "earlier.json"
    result.write_text(json.dumps({"shape": convergence.shape_of(_args()), "results": {"sync fp32": found}}))
    assert convergence.baseline_from(result, _args()) == {**found, "from": str(result)}

    longer = _args()
    longer.rounds = 300
    with pytest.raises(SystemExit, match="another shape \\(rounds 300 here, 4 there\\)"):
        convergence.baseline_from(result, longer)
    # a result written before the shape was recorded: five fields, the others this script's defaults
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"preset": "tiny", "peers": 2, "rounds": 4, "inner_steps": 2, "batch_size": 2,
                               "results": {"sync fp32": found}}))  # fmt: skip
    with pytest.raises(SystemExit, match="warmup 1 here, 50 there, val_batches 1 here, 8 there"):
        convergence.baseline_from(old, _args())
    result.write_text(json.dumps({"shape": convergence.shape_of(_args()), "results": {}}))
    with pytest.raises(SystemExit, match="holds no 'sync fp32' result"):
        convergence.baseline_from(result, _args())


def test_a_record_line_cut_by_a_kill_is_left_out(tmp_path):
    store = RunStore(tmp_path, {"preset": "tiny"})
    key = RunKey("sync fp32", 0.7, 0.7)
    store.begin(key, {})
    store.record_round(key, {"round": 0, "val": 3.0})
    with (tmp_path / f"{key.stem}.jsonl").open("a") as f:
        f.write('{"round": 1, "va')

    assert [line.get("round") for line in store.lines(key)] == [None, 0]
    assert store.finished(key) is None


# ----- the report: gaps over the curve, time to a target on a GPU setting ----------------------------------------


def test_the_gap_to_sync_fp32_is_taken_round_by_round_over_the_whole_curve():
    gaps = quality_report.curve_gaps([3.3, 2.2, 1.06, 1.01], [3.0, 2.0, 1.0, 1.0])

    assert gaps["per_round"] == pytest.approx([0.1, 0.1, 0.06, 0.01])
    assert gaps["mean"] == pytest.approx(0.0675)
    assert gaps["last_half_max"] == pytest.approx(0.06)  # rounds 2 and 3
    assert gaps["final"] == pytest.approx(0.01)


def test_a_round_on_the_gpu_setting_waits_for_what_its_mode_cannot_hide():
    setting = GpuSetting(link_mbit=100)  # 1b on one H100 per peer, 4 peers: the ring outlasts half a round
    compute, ring = setting.round_seconds, setting.fp32_ring_seconds
    assert 0.25 * compute < ring < compute

    wall = quality_report.round_wall_seconds
    assert wall(setting, ratio_vs_fp32_ring=1, mode="sync") == pytest.approx(compute + ring)
    assert wall(setting, ratio_vs_fp32_ring=1, mode="delayed") == pytest.approx(compute)  # hidden behind a round
    assert wall(setting, ratio_vs_fp32_ring=1, mode="streaming", overlap_share=0.25) == pytest.approx(
        compute + ring - 0.25 * compute)  # fmt: skip
    assert wall(setting, ratio_vs_fp32_ring=1, mode="streaming", fragments=2, overlap_share=0.25) == pytest.approx(
        compute + 2 * (ring / 2 - 0.25 * compute / 2))  # fmt: skip
    assert wall(setting, ratio_vs_fp32_ring=100, mode="sync") == pytest.approx(compute + ring / 100)
    with pytest.raises(ValueError, match="unknown outer mode"):
        wall(setting, ratio_vs_fp32_ring=1, mode="ring")


def test_the_bar_needs_100x_fewer_bytes_and_a_gap_within_2_percent_at_the_end_and_5_over_the_last_half():
    def best(curve, ratio):
        return {"best": {"val_curve": curve, "final_val": curve[-1], "ratio_vs_fp32_ring": ratio}}

    results = {
        "sync fp32": best([3.0, 2.0, 1.5, 1.0], 1.0),
        "close": best([3.1, 2.1, 1.53, 1.015], 130.0),
        "late": best([3.1, 2.1, 1.59, 1.015], 130.0),  # within 2% at the end, 6% off in the last half
        "dense": best([3.0, 2.0, 1.5, 1.0], 4.0),
    }
    modes = {label: {"mode": "sync"} for label in results}
    summary = quality_report.summarize(results, modes, setting=GpuSetting(link_mbit=100), target_gap=0.02)

    assert [label for label, s in summary.items() if s["meets_bar"]] == ["close"]
    assert summary["close"]["vs_sync_fp32"] == pytest.approx(0.015)
    # the target is sync fp32's final loss + 2% (1.02): "close" reaches it at round 4, sync fp32 too, but faster
    assert summary["close"]["time_to_target_s"] == pytest.approx(4 * summary["close"]["round_wall_s"])
    assert summary["close"]["time_to_target_s"] < summary["sync fp32"]["time_to_target_s"]
    assert quality_report.time_to_target([3.0, 2.5], 1.0, wall_per_round=10.0) is None


def _written(tmp_path: Path, name: str, curves: dict[str, list[float]], *, rounds: int = 4) -> Path:
    """A result of the lab as convergence.py writes it, with `curves` (label -> val curve) as the best runs."""
    args = _args()
    args.rounds = rounds
    results = {label: {"best": {"val_curve": c, "final_val": c[-1], "ratio_vs_fp32_ring": 1.0 if label == "sync fp32"
                                else 100.0, "outer_lr": 1.0, "outer_momentum": 0.0}} for label, c in curves.items()}  # fmt: skip
    setting = GpuSetting(link_mbit=100)
    summary = quality_report.summarize(results, {label: {"mode": "sync"} for label in results}, setting=setting,
                                       target_gap=0.02)  # fmt: skip
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"shape": convergence.shape_of(args), "gpu_setting": setting.describe(),
                                "target_gap": 0.02, "results": results, "summary": summary}))  # fmt: skip
    return path


def test_the_frontier_of_several_runs_takes_each_configuration_once_and_refuses_runs_that_do_not_compare(tmp_path):
    from benchmarks import quality_frontier

    base = [3.0, 2.0, 1.5, 1.0]
    one = _written(tmp_path, "one", {"sync fp32": base, "sync topk x3": [3.1, 2.2, 1.6, 1.1]})
    two = _written(tmp_path, "two", {"sync fp32": base, "sync int8": [3.0, 2.0, 1.5, 1.01]})
    common, points = quality_frontier.merged([one, two])
    assert sorted(points) == ["sync fp32", "sync int8 (lr 1, m 0)", "sync topk x3 (lr 1, m 0)"]
    assert points["sync int8 (lr 1, m 0)"]["source"] == "two.json"
    assert points["sync topk x3 (lr 1, m 0)"]["vs_sync_fp32"] == pytest.approx(0.1)
    assert "| sync int8 (lr 1, m 0) | 100.0x | 1.0100 | +1.0% |" in quality_frontier.table(points)

    other_baseline = _written(tmp_path, "other", {"sync fp32": [3.0, 2.0, 1.5, 0.99]})
    with pytest.raises(SystemExit, match="sync fp32 curve is not .*one.json's to the bit"):
        quality_frontier.merged([one, other_baseline])
    longer = _written(tmp_path, "longer", {"sync fp32": base}, rounds=300)
    with pytest.raises(SystemExit, match="differs from .*one.json in shape"):
        quality_frontier.merged([one, longer])
    again = _written(tmp_path, "again", {"sync fp32": base, "sync topk x3": [3.1, 2.2, 1.6, 1.2]})
    with pytest.raises(SystemExit, match="the lab should repeat a run to the bit"):
        quality_frontier.merged([one, again])
