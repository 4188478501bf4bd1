"""benchmarks/netns: the arithmetic that maps a GPU setting onto the lab, and how results become targets.

The runs themselves need root and take 25 minutes (`sudo .venv/bin/python -m benchmarks.netns`); these
check the parts a wrong number would hide in: the lab link rate, streaming's scaled tau, the ideal ring
time of the all-reduce alone, the verdict on each target, and that the anchors' trainer still trains.

    python -m pytest tests/unit/test_netns_benchmark.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.netns import allreduce, baselines, report
from benchmarks.netns.gpu import GpuSetting, lab_rate_mbit, ring_bytes, ring_seconds
from benchmarks.netns.variants import VARIANTS, RunShape, outer_choice, peer_cmd

pytestmark = pytest.mark.unit


def test_a_ring_all_reduce_moves_two_n_minus_one_over_n_of_the_payload_each_way():
    assert ring_bytes(1000, 4) == 2 * 3 / 4 * 4 * 1000
    assert ring_bytes(1000, 4, bytes_per_value=2) == 3000
    assert ring_seconds(1e6, 4, 8.0) == pytest.approx(1.5)  # 1.5 MB at 1 MB/s


def test_the_lab_link_gives_the_lab_the_gpu_settings_ratio_of_exchange_to_compute():
    gpu = GpuSetting(link_mbit=100.0)
    lab_params, lab_round = 241_024, 3.6
    rate = lab_rate_mbit(gpu, lab_params=lab_params, lab_round_seconds=lab_round)
    lab_ratio = ring_seconds(4 * lab_params, gpu.peers, rate) / lab_round
    assert lab_ratio == pytest.approx(gpu.ratio)


def test_a_ten_times_faster_gpu_link_is_a_ten_times_faster_lab_link():
    slow, fast = GpuSetting(link_mbit=100.0), GpuSetting(link_mbit=1000.0)
    assert fast.ratio == pytest.approx(slow.ratio / 10)
    rates = [lab_rate_mbit(g, lab_params=10_000, lab_round_seconds=2.0) for g in (slow, fast)]
    assert rates[1] == pytest.approx(10 * rates[0])


def test_the_gpu_round_is_h_steps_of_six_flops_per_parameter_and_token():
    gpu = GpuSetting(link_mbit=100.0, peak_tflops=100.0, mfu=0.5, tokens_per_step=1000, inner_steps=10)
    assert gpu.step_seconds == pytest.approx(6 * gpu.params * 1000 / 50e12)
    assert gpu.round_seconds == pytest.approx(10 * gpu.step_seconds)
    assert gpu.ddp_slowdown == pytest.approx(1 + gpu.fp32_ring_seconds / gpu.step_seconds)
    assert "1b on one H100 SXM per peer at 100 Mbit/s" == gpu.name
    assert GpuSetting(link_mbit=1000.0).name.endswith("at 1 Gbit/s")


@pytest.mark.parametrize(
    ("lab_h", "gpu_h", "fragments", "tau"),
    [
        (20, 100, 1, 1),  # join's tau 5 of 100 steps is 1 of 20
        (20, 100, 2, 1),
        (100, 100, 1, 5),  # the lab's H is the GPU's: join's own default
        (20, 0, 1, 5),  # no GPU setting: the lab's H
        (10, 500, 1, 1),  # never below one step
        (100, 100, 50, 2),  # min(5, H / P)
    ],
)
def test_streamings_tau_hides_the_share_of_a_round_the_gpu_setting_would(lab_h, gpu_h, fragments, tau):
    shape = RunShape(peers=4, preset="tiny", rounds=3, inner_steps=lab_h, batch_size=4, warmup=1, gpu_inner_steps=gpu_h)
    assert shape.overlap_steps(fragments) == tau


def test_a_variant_may_set_tau_as_a_share_of_a_sync_round_at_either_h():
    shape = RunShape(peers=4, preset="tiny", rounds=3, inner_steps=20, batch_size=4, warmup=1, gpu_inner_steps=100)
    assert shape.overlap_steps(1, 0.5) == 10 and shape.overlap_steps(1, 0.75) == 15 and shape.overlap_steps(2, 0.5) == 5
    assert shape.overlap_steps(1, 0.001) == 1  # never below one step


def test_streaming_variants_run_with_the_scaled_tau_and_others_without_one(tmp_path):
    shape = RunShape(peers=4, preset="tiny", rounds=3, inner_steps=20, batch_size=4, warmup=1, gpu_inner_steps=100)

    def cmd(name: str) -> list[str]:
        variant = VARIANTS[name]
        outer = outer_choice(variant, hivemind_lr=0.7, hivemind_momentum=0.9)
        return peer_cmd(shape, variant, outer, host=1, ip="10.0.0.2", leader_ip="10.0.0.1", run_dir=tmp_path)

    assert cmd("fp4")[cmd("fp4").index("--overlap-steps") + 1] == "1"
    assert cmd("int8")[cmd("int8").index("--overlap-steps") + 1] == "1"
    assert "--overlap-steps" not in cmd("default")  # join's default mode is sync
    assert cmd("int8-tau-half")[cmd("int8-tau-half").index("--overlap-steps") + 1] == "10"
    assert "--overlap-steps" not in cmd("sync-fp32")
    assert "--no-swarm" in cmd("nocomm")
    assert cmd("ddp-gloo")[2:4] == ["benchmarks.netns.baselines", "ddp"]


def test_the_all_reduce_alone_is_judged_against_the_ring_time_of_its_own_payload():
    numel, peers, rate = 1_000_000, 4, 80.0
    rows = [
        {"strategy": s, "round": t, "start": 10.0 * t, "end": 10.0 * t + secs, "bytes_sent": sent, "kind": "k",
         "group_size": peers}
        for s, secs, sent in (("none", 0.9, 6e6), ("int8", 0.6, 3e6))
        for t in (0, 1, 2)
        for _ in range(peers)
    ]  # fmt: skip
    none, int8 = allreduce.summarize(rows, peers=peers, rate_mbit=rate, numel=numel)
    assert none["payload_bytes"] == 4 * numel
    assert none["ideal_ring_seconds"] == pytest.approx(0.6)  # 1.5 x 4 MB at 10 MB/s
    assert none["vs_ideal"] == pytest.approx(1.5)
    # int8 rides the compressed butterfly: 3 MB sent is 1.5 x its 2 MB message, a ring's share
    assert int8["payload_bytes"] == pytest.approx(2e6)
    assert int8["vs_ideal"] == pytest.approx(0.6 / 0.3)
    assert int8["vs_algorithm_ideal"] == pytest.approx(2.0)  # 3 MB through a 10 MB/s link: 0.3 s at best
    assert none["seconds_each"] == [pytest.approx(0.9)] * 2  # round 0 is the warm-up


@pytest.mark.parametrize(("strategy", "peers", "sends"), [
    ("none", 4, 1.5), ("fp16", 4, 1.5), ("int8", 8, 1.75), ("fp4", 3, 4 / 3), ("lowrank", 4, 1.5),
    ("topk", 3, 2.0),  # all-gathered in groups of 3 (compression.topk_transport auto)
    ("topk", 4, 3.0),  # the butterfly: (N-1)/N x (1 + 3)
])  # fmt: skip
def test_a_members_bytes_are_its_message_times_what_its_algorithm_sends(strategy, peers, sends):
    assert allreduce.sends_per_message(strategy, peers) == pytest.approx(sends)


def _result(tokens_per_s: float, ratio: float, val: float, speedup: float | None = None) -> dict:
    return {"tokens_per_s": tokens_per_s, "utilization": tokens_per_s / 100.0, "ratio_to_fp32_ring": ratio,
            "payload_ratio_to_fp32_ring": ratio / 2, "final_val_loss": val, "speedup_vs_ideal": speedup}  # fmt: skip


def test_each_target_is_met_or_not_by_its_measured_value():
    results = {"slow": {"nocomm": _result(100.0, 0.0, 2.0), "ddp-gloo": _result(10.0, 20.0, 2.0, 0.1),
                        "sync-fp32": _result(50.0, 1.2, 2.5, 0.5), "default": _result(96.0, 0.005, 2.4, 0.96)}}  # fmt: skip
    rows = report.targets(results, [{"strategy": "none", "vs_ideal": 1.3}], first="slow", ours=["sync-fp32", "default"])
    verdict = {(r["target"].split(" ")[0], r["variant"]): r["met"] for r in rows}
    assert verdict[("wire", "default")] and not verdict[("wire", "sync-fp32")]
    assert verdict[("utilization", "default")]
    assert verdict[("speedup", "default")] and not verdict[("speedup", "sync-fp32")]
    assert verdict[("val", "default")]  # 2.4 <= 2.5
    assert not verdict[("all-reduce", "none")]
    assert "| **no** |" in report.markdown(_payload(results, rows))


def _payload(results: dict, targets: list[dict]) -> dict:
    for r in results["slow"].values():
        r.update(mode="m", compression="c", outer_lr=None, outer_momentum=None, wire_bytes_per_peer_per_round=1e6,
                 wall_s=1.0, wait_share=0.1, hashes_equal=True)  # fmt: skip
    gpu = GpuSetting(link_mbit=100.0).describe() | {"name": "slow"}
    return {"command_line": "python -m benchmarks.netns", "results": results, "allreduce": [], "targets": targets,
            "settings": {"gpu": [gpu], "lab_rates_mbit": {"slow": 5.0}, "rounds": {"slow": 8}}, "notes": ["n"]}  # fmt: skip


def test_the_anchors_trainer_takes_a_step_with_the_peers_own_inner_trainer(tmp_path):
    # DDP and hivemind train with join's InnerTrainer (same micro-batches, loss scaling, optimizer); a change of its
    # API (a 1-stage model no longer runs through a pipeline schedule) broke both anchors, found only when the
    # 25-minute benchmark ran
    args = baselines.parse_args(["ddp", "--run-dir", str(tmp_path), "--rounds", "1", "--inner-steps", "2"])
    trainer = baselines.Trainer(baselines._config(args), host=0, group=None)
    before = [p.detach().clone() for p in trainer.params]
    loss = trainer.backward()
    assert math.isfinite(loss) and all(p.grad is not None for p in trainer.params)
    trainer.step(0)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params))
