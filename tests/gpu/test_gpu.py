"""A peer on NVIDIA GPUs: bf16 + the stage compiled whole on one GPU, a pipeline over NCCL on two, `--devices`,
two replicas of a stage (`--replicas`).

    pytest -m gpu tests/gpu -q          # on a machine with CUDA (two GPUs for the pipeline test)

Never needed by CI (its machines have no GPU): without CUDA, or with fewer GPUs than a test needs, these are
skipped with the reason (tests/conftest.py); the test command's tiers (`-m "unit or swarm"`, `-m "netns or
docker"`) do not select them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dilocox_p2p.errors import ConfigError
from tests.helpers.artifacts import ROOT

pytestmark = pytest.mark.gpu

# a plain `join` in its own process (no zygote: a GPU machine's image may lack hivemind, which --no-swarm never needs)
GPU_ARGS = ["--no-swarm", "--device", "cuda", "--preset", "tiny", "--rounds", "2", "--inner-steps", "5",
            "--data-seed", "0", "--progress", "off", "--set", "inner.batch_size=4"]  # fmt: skip


class Peer:
    def __init__(self, run_dir: Path, args: list[str]):
        self.run_dir = run_dir
        cmd = [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-dir", str(run_dir), *args]
        self.proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)

    def output(self) -> str:
        return (self.proc.stdout + self.proc.stderr)[-5000:]

    def stage_log(self, stage: int) -> str:
        return (self.run_dir / "logs" / f"stage{stage}.log").read_text()

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.gpu_count(1)
def test_one_gpu_trains_in_bf16_with_the_stage_compiled_whole_and_reports_its_peak_memory(tmp_path):
    peer = Peer(tmp_path / "gpu", [*GPU_ARGS, "--stages", "1", "--set", "inner.microbatches=1"])
    assert peer.proc.returncode == 0, peer.output()
    log = peer.stage_log(0)
    assert "inner: bf16 on cuda:0, compiled" in log, log[-3000:]
    records = peer.metrics()
    assert len(records) == 2 and all(r["peak_gpu_bytes"][0] > 0 for r in records)
    assert records[-1]["val_loss"] < records[0]["val_loss"] or records[-1]["train_loss"] < records[0]["train_loss"]


@pytest.mark.gpu_count(2)
def test_two_stages_train_over_nccl_on_the_gpus_devices_names_in_stage_order(tmp_path):
    peer = Peer(tmp_path / "pipe", [*GPU_ARGS, "--stages", "2", "--devices", "cuda:1", "cuda:0",
                                    "--set", "inner.microbatches=2"])  # fmt: skip
    assert peer.proc.returncode == 0, peer.output()
    assert "inner: bf16 on cuda:1" in peer.stage_log(0)
    assert "inner: bf16 on cuda:0" in peer.stage_log(1)
    assert len(peer.metrics()) == 2


@pytest.mark.gpu_count(2)
def test_two_replicas_of_one_stage_average_their_gradients_over_nccl_and_train_as_one(tmp_path):
    # DP inside the peer (replicas.py): replica 1's copy of the stage on cuda:1 follows replica 0's on cuda:0; beside
    # it the same peer on one GPU, on the same data: the same losses to bf16's rounding
    args = [*GPU_ARGS, "--stages", "1", "--set", "inner.microbatches=1", "--set", "inner.compile=off"]
    one, two = Peer(tmp_path / "one", args), Peer(tmp_path / "two", [*args, "--replicas", "2"])
    for peer in (one, two):
        assert peer.proc.returncode == 0, peer.output()
    assert "replica 1 of 2: follows replica 0's stage 0" in (two.run_dir / "logs" / "stage0.replica1.log").read_text()
    for a, b in zip(one.metrics(), two.metrics(), strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-2), (a["round"], a["train_loss"], b["train_loss"])


@pytest.mark.gpu_count(1)
def test_a_stage_on_a_gpu_this_process_cannot_see_is_refused_with_the_count_it_sees():
    import torch

    from dilocox_p2p.peer_layout import resolve_device

    count = torch.cuda.device_count()
    assert resolve_device("auto", 0, [f"cuda:{count - 1}"]) == torch.device("cuda", count - 1)
    with pytest.raises(ConfigError, match=f"this process sees {count} GPU"):
        resolve_device("auto", 0, [f"cuda:{count}"])
