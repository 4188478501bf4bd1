#!/usr/bin/env python3
"""Compression of a real pseudo-gradient, per strategy: bytes, ratio, error, speed, memory.

    python benchmarks/compression.py                            # small preset, stage 0 of 2, H=10
    python benchmarks/compression.py --preset tiny --inner-steps 20 --name compression_tiny

The pseudo-gradient is real: `dilocox-peer join --no-swarm` trains the preset for one round
of H inner steps, and delayed mode keeps that round's delta (the pending average of a peer
alone) in the round-1 checkpoint. Each strategy then runs in its own process (so that its
peak memory is its own) as one member of a group of three whose members hold this delta:
encode it (error feedback on), decode the three messages (low-rank: both phases), for
--repeats rounds; the three messages are distinct copies, as the gather holds them. Reported per strategy: bytes per message and per round in the group
(all-gather: N-1 messages out), the ratio to an fp32 ring all-reduce (2 (N-1)/N x 4 bytes x
params per member), the relative L2 error of the first round's decoded mean (no error
feedback yet), encode / low-rank phase 2 / decode seconds (medians), and the peak memory
above the delta itself, in fp32 copies of the stage shard: in all, and the codec's own part
(all, less the group's messages: what an all-gather must hold whatever the codec does; the
error-feedback buffer and the decoded mean are the codec's). Each measuring process runs with
glibc's mmap threshold fixed at 128 KiB, so that freed tensors leave the resident set at once
and its peak is the peak of live memory. Writes benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402

STRATEGIES = {
    "fp16": {"kind": "fp16"},
    "int8": {"kind": "int8"},
    "topk (64 of 4096, 2-bit)": {"kind": "topk"},
    "lowrank (default: adaptive rank, int4)": {"kind": "lowrank"},
    "lowrank r=8 int4": {"kind": "lowrank", "rank": 8, "energy_target": 0.0},
    "lowrank r=32 int4": {"kind": "lowrank", "rank": 32, "energy_target": 0.0},
}
GROUP = 3
MMAP_THRESHOLD = 128 * 1024


def make_delta(args: argparse.Namespace, tmp: Path) -> Path:
    """Train one round of the preset alone; return the file holding stage 0's pseudo-gradient."""
    run_dir = tmp / "run"
    cmd = [
        sys.executable, "-m", "dilocox_p2p.cli", "join", "--no-swarm", "--run-dir", str(run_dir),
        "--preset", args.preset, "--stages", str(args.stages), "--device", args.device, "--mode", "delayed",
        "--rounds", "2", "--inner-steps", str(args.inner_steps), "--batch-size", str(args.batch_size),
        "--microbatches", str(args.microbatches), "--progress", "off", "--log-level", "warning", "--data-seed", "0",
        "--set", "inner.warmup_steps=0",
    ]  # fmt: skip
    print(f"training {args.preset} for one round of {args.inner_steps} steps ...", flush=True)
    subprocess.run(cmd, check=True)
    import torch

    from dilocox_p2p.checkpoint import load_checkpoint
    from dilocox_p2p.config import PRESETS
    from dilocox_p2p.model import build_stage

    state = load_checkpoint(run_dir, 0, 1)
    pending = state["outer"]["pending"]
    assert pending is not None and pending["round"] == 0, "round 1's checkpoint lacks round 0's pseudo-gradient"
    names = [n for n, _ in build_stage(PRESETS[args.preset], args.stages, 0, 0).named_parameters()]
    path = tmp / "delta.pt"
    torch.save({"names": names, "tensors": list(pending["tensors"])}, path)
    return path


def measure(delta_path: str, settings: dict, repeats: int) -> dict:
    """Runs in its own process: one strategy, one member of a group whose members hold the same delta
    (so the decoded mean should be the delta itself)."""
    import torch

    from dilocox_p2p.compression.codec import StageCodec
    from dilocox_p2p.config import CompressionConfig

    saved = torch.load(delta_path)
    names, delta = saved["names"], saved["tensors"]
    params = sum(t.numel() for t in delta)
    base_rss = _reset_peak_rss()
    codec = StageCodec(CompressionConfig(**settings), names, [t.shape for t in delta], run_id="bench")
    times: dict[str, list[float]] = {"encode_s": [], "phase2_s": [], "decode_s": []}
    for round in range(repeats):
        started = time.perf_counter()
        round_codec = codec.begin(round, delta)
        gathered = _group(round_codec.message(1))
        times["encode_s"].append(time.perf_counter() - started)
        sizes = [len(gathered[0])]
        if codec.phases == 2:  # decode the group's P, its exact basis, encode Q
            started = time.perf_counter()
            gathered = _group(round_codec.message(2, gathered))
            times["phase2_s"].append(time.perf_counter() - started)
            sizes.append(len(gathered[0]))
        started = time.perf_counter()
        average = round_codec.average(gathered, own=0)
        times["decode_s"].append(time.perf_counter() - started)
        if round == 0:
            num = sum(_squares(a, d) for a, d in zip(average.tensors, delta))
            den = sum(_squares(d) for d in delta)
        del average, gathered, round_codec  # the outer loop's business from here (it applies the mean)
    peak_rss = _status_bytes("VmHWM")
    message = sum(sizes)
    medians = {k: statistics.median(v) if v else 0.0 for k, v in times.items()}
    return {
        "params": params,
        "message_bytes": message,
        "ratio_vs_fp32_message": 4 * params / message,
        "bytes_sent_per_round": (GROUP - 1) * message,
        "ratio_vs_fp32_ring": (2 * (GROUP - 1) / GROUP * 4 * params) / ((GROUP - 1) * message),
        "relative_error_first_round": (num / den) ** 0.5,
        **medians,
        "total_s": sum(medians.values()),
        "peak_extra_fp32_copies": (peak_rss - base_rss) / (4 * params),
        "messages_fp32_copies": GROUP * max(sizes) / (4 * params),
        "codec_peak_fp32_copies": (peak_rss - base_rss - GROUP * max(sizes)) / (4 * params),
        "codec_metrics": codec.metrics(),
    }


def _squares(a, b=None) -> float:
    """sum((a - b)^2) (or of a) in float64, a small piece at a time (the measure must not raise the peak)."""
    pieces = zip(a.reshape(-1).split(1 << 16), b.reshape(-1).split(1 << 16) if b is not None else iter(lambda: 0.0, 1))
    return sum(float(((x.double() - y) ** 2).sum()) for x, y in pieces)


def _status_bytes(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset this process's peak resident memory to what it holds now (so that loading the delta does not
    count), and return that."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _group(message: bytes) -> list[bytes]:
    """The group's messages of a phase: this member's and two copies standing for the others'."""
    return [message] + [bytes(bytearray(message)) for _ in range(GROUP - 1)]


def step_seconds(args: argparse.Namespace, tmp: Path) -> float:
    """Seconds of one inner step of the whole peer on this machine (the scale for encode/decode)."""
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return min(r["seconds_compute"] for r in records) / args.inner_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the round that makes the pseudo-gradient trains (the codecs run on the CPU, "
                        "as in the averager process)")
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="compression")
    parser.add_argument("--measure", nargs=2, metavar=("DELTA", "SETTINGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], json.loads(args.measure[1]), args.repeats)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        delta_path = make_delta(args, Path(tmp))
        step_s = step_seconds(args, Path(tmp))
        results = {}
        for label, settings in STRATEGIES.items():
            cmd = [sys.executable, __file__, "--measure", str(delta_path), json.dumps(settings),
                   "--repeats", str(args.repeats)]  # fmt: skip
            # a fixed mmap threshold: every large block goes back to the OS when freed, so the peak
            # resident memory is the peak of live memory, not of what glibc's heap kept around
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            results[label] = {"settings": settings, **json.loads(out.stdout.strip().splitlines()[-1])}
            r = results[label]
            print(f"{label:40s} {r['message_bytes']:>10,d} B/message  x{r['ratio_vs_fp32_ring']:7.1f} vs fp32 ring  "
                  f"err {r['relative_error_first_round']:.3f}  codec {r['total_s']:.2f}s/round  "
                  f"peak +{r['peak_extra_fp32_copies']:.1f} copies (codec +{r['codec_peak_fp32_copies']:.1f})", flush=True)
    path = write_result(args.name, {
        "preset": args.preset, "stage": 0, "stages": args.stages, "device": args.device, "inner_steps": args.inner_steps,
        "group_size": GROUP, "inner_step_s": step_s, "strategies": results,
    })  # fmt: skip
    print(f"one inner step of the whole peer: {step_s:.2f}s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
