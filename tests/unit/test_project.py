"""benchmarks/project.py: the DiLoCoX projection's arithmetic, checked on hand-computed cases.

    python -m pytest tests/unit/test_project.py -q
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.project import (
    FP32,
    Baseline,
    Cluster,
    Compute,
    Overlap,
    Strategy,
    all_gather_seconds,
    ddp_step_seconds,
    exchange_seconds,
    load_measured,
    project,
    ratio_vs_fp32_ring,
    ring_allreduce_seconds,
    round_wall_seconds,
    step_compute_seconds,
)

pytestmark = pytest.mark.unit

# 1e9 params, 2 peers of 2 stages, 8 Gbit/s = 1e9 bytes/s: every figure below is easy to do by hand
SMALL = Cluster(params=1e9, peers=2, stages=2, gpus_per_stage=1, link_gbit=8.0)
COMPUTE = Compute(peak_tflops=1.0, mfu=0.5, tokens_per_step=1000, inner_steps=10, backward_share=0.5)


def test_an_ideal_ring_moves_2_n_minus_1_over_n_of_the_payload():
    # notes/hivemind-facts.md: 4 peers, 100 MB each, 100 Mbit/s -> an ideal ring of 12.0 s
    assert ring_allreduce_seconds(100e6, 4, 100e6 / 8) == pytest.approx(12.0)
    assert ring_allreduce_seconds(1e9, 2, 1e9) == pytest.approx(1.0)


def test_an_all_gather_sends_the_message_to_each_other_member():
    assert all_gather_seconds(1e6, 3, 1e6) == pytest.approx(2.0)
    assert all_gather_seconds(1e6, 10, 1e6) == pytest.approx(9.0)


def test_the_ratio_to_the_fp32_ring_shrinks_as_2_over_n_for_gathered_messages():
    topk = Strategy(name="topk", message_ratio=194.69, all_gather=True)
    # README: 130x at N = 3, 97x at N = 4, 39x at N = 10
    assert [round(ratio_vs_fp32_ring(topk, n)) for n in (3, 4, 10)] == [130, 97, 39]
    assert ratio_vs_fp32_ring(FP32, 10) == 1.0


def test_a_step_is_6_n_flops_a_token_over_the_peers_gpus():
    # 6 x 1e9 x 1000 FLOPs / (2 stages x 1 GPU x 1e12 x 0.5) = 6 s
    assert step_compute_seconds(SMALL, COMPUTE) == pytest.approx(6.0)
    assert step_compute_seconds(replace(SMALL, gpus_per_stage=3), COMPUTE) == pytest.approx(2.0)


def test_ddp_waits_for_its_all_reduce_or_hides_it_behind_backward_only():
    # all-reduce: 2 (2-1)/2 x 2 bytes x 1e9 / 1e9 bytes/s = 2 s; compute 6 s, backward half of it
    baseline = Baseline(grad_bytes=2)
    assert ddp_step_seconds(SMALL, COMPUTE, baseline, overlapped=False) == pytest.approx(8.0)
    assert ddp_step_seconds(SMALL, COMPUTE, baseline, overlapped=True) == pytest.approx(6.0)  # 3 + max(3, 2)
    slow = replace(SMALL, link_gbit=0.8)  # all-reduce 20 s
    assert ddp_step_seconds(slow, COMPUTE, baseline, overlapped=True) == pytest.approx(23.0)  # 3 + max(3, 20)
    assert ddp_step_seconds(slow, COMPUTE, Baseline(grad_bytes=4), overlapped=False) == pytest.approx(46.0)


def test_a_link_per_stage_carries_only_that_stages_share():
    per_stage = replace(SMALL, link_scope="stage")
    baseline = Baseline(grad_bytes=2)
    assert ddp_step_seconds(per_stage, COMPUTE, baseline, overlapped=False) == pytest.approx(6.0 + 1.0)


def test_the_delayed_exchange_hides_up_to_the_rounds_compute():
    delayed = Overlap(mode="delayed")
    assert round_wall_seconds(1.0, 4.0, delayed, inner_steps=10) == pytest.approx(10.0)  # max(10, 4)
    assert round_wall_seconds(1.0, 30.0, delayed, inner_steps=10) == pytest.approx(30.0)  # max(10, 30)
    assert round_wall_seconds(1.0, 4.0, delayed, inner_steps=10, encode_s=0.5) == pytest.approx(10.5)
    lossy = Overlap(mode="delayed", utilization=0.8)  # a fifth of the throughput lost: +0.25 of the compute
    assert round_wall_seconds(1.0, 4.0, lossy, inner_steps=10) == pytest.approx(12.5)


def test_a_streaming_fragment_hides_only_behind_tau_steps():
    streaming = Overlap(mode="streaming", fragments=2, overlap_steps=1)
    # 10 steps of 10 s; each of 2 fragments takes 15 s against a 10 s window: 2 x 5 s of waiting
    assert round_wall_seconds(10.0, 30.0, streaming, inner_steps=10) == pytest.approx(110.0)
    assert round_wall_seconds(10.0, 20.0, streaming, inner_steps=10) == pytest.approx(100.0)


def test_fp32_exchanges_through_the_butterfly_and_compressed_messages_are_gathered():
    overlap = Overlap(allreduce_vs_ideal=1.5)
    four = replace(SMALL, peers=4)
    # fp32: 2 x 3/4 x 4e9 bytes / 1e9 = 6 s, x 1.5 measured efficiency
    assert exchange_seconds(FP32, four, overlap) == pytest.approx(9.0)
    # 100x: a 4e7-byte message sent 3 times = 0.12 s, x 1.5; decode 1e-9 s/param/member x 4 x 5e8 params = 2 s
    codec = Strategy(name="c", message_ratio=100.0, all_gather=True, background_s_per_param_member=1e-9)
    assert exchange_seconds(codec, four, overlap) == pytest.approx(0.18 + 2.0)


def test_a_faster_link_never_lowers_either_sides_throughput():
    strategies = (FP32, Strategy(name="c", message_ratio=50.0, all_gather=True))
    last: dict[str, float] = {}
    for gbit in (0.01, 0.1, 0.5, 1, 2, 10, 100):
        r = project(replace(SMALL, link_gbit=gbit), COMPUTE, Baseline(), Overlap(), strategies)
        now = {k: d["tokens_per_s"] for k, d in r["ddp"].items()} | {k: o["tokens_per_s"] for k, o in r["ours"].items()}
        assert all(now[k] >= last.get(k, 0.0) for k in now), (gbit, now, last)
        last = now


def test_the_projection_reports_tokens_per_second_and_speedup_by_hand():
    r = project(SMALL, COMPUTE, Baseline(grad_bytes=2), Overlap(), (FP32,))
    assert r["ddp"]["not_overlapped"]["tokens_per_s"] == pytest.approx(2 * 1000 / 8.0)
    ours = r["ours"][FP32.name]  # exchange 4 s hides behind 60 s of compute
    assert ours["tokens_per_s"] == pytest.approx(2 * 1000 * 10 / 60.0)
    assert ours["speedup_vs_ddp"] == pytest.approx((2 * 1000 * 10 / 60.0) / (2 * 1000 / 6.0))
    assert ours["exchange_hidden"] and ours["utilization"] == pytest.approx(1.0)


def test_bad_assumptions_are_refused():
    with pytest.raises(ValueError):
        Cluster(peers=1)
    with pytest.raises(ValueError):
        Compute(mfu=1.5)
    with pytest.raises(ValueError):
        Overlap(utilization=0.0)


def test_missing_results_give_flagged_defaults(tmp_path):
    measured = load_measured(tmp_path)
    assert measured.utilization.value == 1.0 and not measured.utilization.measured
    assert measured.allreduce_vs_ideal.value == 1.0 and not measured.allreduce_vs_ideal.measured
    assert measured.strategies == (FP32,)
    assert any("compression.json missing" in note for note in measured.notes)


def _netns_json(tmp_path) -> None:
    (tmp_path / "netns.json").write_text(json.dumps({
        "results": {
            "slow": {"lowrank": {"utilization": 0.7, "rate_mbit": 2.0}},
            "fast": {"lowrank": {"utilization": 0.9, "rate_mbit": 20.0}, "sync-fp32": {"utilization": 0.5}},
        },
        "allreduce": [
            {"strategy": "topk", "vs_ideal": 40.0, "values": 10, "rate_mbit": 100.0, "seconds": 1.0},
            {"strategy": "none", "vs_ideal": 1.3, "values": 10, "rate_mbit": 100.0, "seconds": 8.0},
        ],
    }))  # fmt: skip


def test_netns_figures_are_the_fastest_settings_lowrank_utilization_and_the_fp32_butterflys_efficiency(tmp_path):
    _netns_json(tmp_path)
    measured = load_measured(tmp_path)
    assert measured.utilization.value == pytest.approx(0.9) and measured.utilization.measured
    assert "results['fast'].lowrank.utilization" in measured.utilization.source
    assert measured.allreduce_vs_ideal.value == pytest.approx(1.3) and "strategy none" in measured.allreduce_vs_ideal.source


def test_the_dedicated_overlap_measurement_wins_over_netns_lowrank_which_also_pays_its_codec(tmp_path):
    _netns_json(tmp_path)
    (tmp_path / "overlap.json").write_text(json.dumps({"ratio_summary": {"delayed (helper_nice 0)": {"mean": 0.97}}}))
    measured = load_measured(tmp_path)
    assert measured.utilization.value == pytest.approx(0.97)
    assert measured.utilization.source.startswith("overlap.json")
