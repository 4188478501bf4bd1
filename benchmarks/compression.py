#!/usr/bin/env python3
"""Compression of a real pseudo-gradient, per strategy: bytes, ratio, error, speed, memory.

    python benchmarks/compression.py                            # small preset, stage 0 of 2, H=10
    python benchmarks/compression.py --preset tiny --inner-steps 20 --name compression_tiny

The pseudo-gradient is real: `dilocox-peer join --no-swarm` trains the preset for one round
of H inner steps, and delayed mode keeps that round's delta (the pending average of a peer
alone) in the round-1 checkpoint. Each strategy then runs in its own process as member 0 of a group of three whose members hold
this delta, over the transport it takes in such a group (the compressed butterfly: encode and
cut its message, reduce its span of the group's parts, assemble the reduced parts, low-rank
twice; top-k below a group of 4: the all-gather, decode the group's messages), for one first
round and then --repeats rounds; only member 0's own work is timed. Reported per strategy: bytes per message and those
member 0 sends in a round, the ratio to an fp32 ring all-reduce (2 (N-1)/N x 4 bytes x params
per member), the relative L2 error of the first round's decoded mean (no error feedback yet),
encode / low-rank phase 2 / decode seconds (medians of the rounds after the first, with the process's own allocator,
as in a peer: the first round of a codec's life also makes its buffers, several times a later round's work on a
fresh process at 350m, and is reported apart, `first_round_s`), their share of a round of --horizon inner steps of the preset on --device (a bf16
round on CUDA), and, in another process with glibc's mmap threshold fixed at 128 KiB (freed
tensors leave the resident set at once, so its peak is the peak of live memory), the largest
transient memory of member 0's calls (peak during a call above what the process held as it
began, in fp32 copies of the stage shard; the error-feedback buffer, one copy, stays between
rounds). Writes benchmarks/results/<name>.json.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


class Meter:
    """Seconds per phase of member 0's own calls, per round, and the largest transient memory of any of them: the
    peak resident memory during the call above what the process held when it began."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {"encode_s": [], "phase2_s": [], "decode_s": []}
        self.transient = 0

    def new_round(self) -> None:
        for spent in self.times.values():
            spent.append(0.0)

    def timed(self, key: str, work: Callable[[], Any]) -> Any:
        before = _reset_peak_rss()
        started = time.perf_counter()
        out = work()
        self.times[key][-1] += time.perf_counter() - started
        self.transient = max(self.transient, _status_bytes("VmHWM") - before)
        return out


def measure(delta_path: str, settings: dict, repeats: int) -> dict:
    """Runs in its own process: one strategy, member 0 of a group of GROUP whose members hold the same delta (so
    the decoded mean should be the delta itself), over the transport the strategy takes in such a group: the
    compressed butterfly (the quantizers; low-rank, both phases; top-k from a group of 4) or the all-gather. Only
    member 0's own work is timed; the other members' (their messages, their reducers' spans) is done untimed."""
    import torch

    from dilocox_p2p.compression.codec import StageCodec
    from dilocox_p2p.config import CompressionConfig

    saved = torch.load(delta_path)
    names, delta = saved["names"], saved["tensors"]
    params = sum(t.numel() for t in delta)
    cfg = CompressionConfig(**settings)
    shapes = [t.shape for t in delta]
    codec = StageCodec(cfg, names, shapes, run_id="bench")
    butterfly = cfg.kind == "lowrank" or codec.rides_butterfly(GROUP)
    others = [StageCodec(cfg, names, shapes, run_id="bench") for _ in range(GROUP - 1)] if butterfly else []
    meter = Meter()
    for round in range(1 + repeats):  # the first round apart (module docstring)
        meter.new_round()
        run = _butterfly_round if butterfly else _gathered_round
        average, sizes, sent = run([codec, *others], round, delta, meter)
        if round == 0:
            num = sum(_squares(a, d) for a, d in zip(average, delta))
            den = sum(_squares(d) for d in delta)
        del average  # the outer loop's business from here (it applies the mean)
    message = sum(sizes)
    medians = {k: statistics.median(v[1:]) if any(v[1:]) else 0.0 for k, v in meter.times.items()}
    per_round = [sum(spent[i] for spent in meter.times.values()) for i in range(1 + repeats)]
    return {
        "transport": "butterfly" if butterfly else "gather",
        "params": params,
        "message_bytes": message,
        "ratio_vs_fp32_message": 4 * params / message,
        "bytes_sent_per_round": sent,
        "ratio_vs_fp32_ring": (2 * (GROUP - 1) / GROUP * 4 * params) / sent,
        "relative_error_first_round": (num / den) ** 0.5,
        **medians,
        "total_s": sum(medians.values()),
        "first_round_s": per_round[0],
        "rounds_total_s": per_round,
        "transient_peak_fp32_copies": meter.transient / (4 * params),
        "codec_metrics": codec.metrics(),
    }


def _gathered_round(codecs: list, round: int, delta: list, meter: Meter) -> tuple[list, list[int], int]:
    """The all-gather: encode this member's message, decode the group's (low-rank: both phases)."""
    (codec,) = codecs
    round_codec = meter.timed("encode_s", lambda: codec.begin(round, delta))
    gathered = _group(meter.timed("encode_s", lambda: round_codec.message(1)))
    sizes = [len(gathered[0])]
    if codec.phases == 2:  # decode the group's P, its exact basis, encode Q
        gathered = _group(meter.timed("phase2_s", lambda: round_codec.message(2, gathered)))
        sizes.append(len(gathered[0]))
    average = meter.timed("decode_s", lambda: round_codec.average(gathered, own=0))
    return average.tensors, sizes, (GROUP - 1) * sum(sizes)


def _butterfly_round(codecs: list, round: int, delta: list, meter: Meter) -> tuple[list, list[int], int]:
    """The compressed butterfly, as member 0 works it: encode and cut its message, reduce its span of the group's
    parts, assemble the reduced parts (low-rank: the same again for phase 2, "phase2_s", then the average)."""
    from dilocox_p2p.compression.butterfly import assemble, cut_all, low_rank_average, low_rank_second, part_spans, reduce

    timed = meter.timed
    sent: list[int] = []

    def phase(messages: list[bytes], number: int, key: str):
        """Cut every member's message, reduce every span (member 0's timed), assemble (member 0's timed)."""
        spans = part_spans(messages[0], GROUP)
        parts = [timed(key, lambda: cut_all(messages[0], GROUP))] + [cut_all(m, GROUP) for m in messages[1:]]
        reduced = [timed(key, lambda: reduce(rounds[0], [p[0] for p in parts], span=spans[0], phase=number))]
        reduced += [reduce(rounds[k], [p[k] for p in parts], span=spans[k], phase=number) for k in range(1, GROUP)]
        blobs = [r.blob for r in reduced]
        assembled = [timed(key, lambda: assemble(rounds[0], blobs, spans=spans, own=0, phase=number))]
        assembled += [assemble(r, blobs, spans=spans, own=i, phase=number) for i, r in enumerate(rounds) if i]
        sent.append(sum(len(p) for p in parts[0][1:]) + (GROUP - 1) * len(blobs[0]))  # its parts, its reduced part
        return assembled, reduced

    rounds = [timed("encode_s", lambda: codecs[0].begin(round, delta))] + [c.begin(round, delta) for c in codecs[1:]]
    first = [timed("encode_s", lambda: rounds[0].message(1))] + [r.message(1) for r in rounds[1:]]
    p_means, _ = phase(first, 1, "decode_s")
    if codecs[0].cfg.kind != "lowrank":
        return p_means[0].tensors, [len(first[0])], sum(sent)
    second = [timed("phase2_s", lambda: low_rank_second(rounds[0], p_means[0]))]
    second += [low_rank_second(r, a) for r, a in zip(rounds[1:], p_means[1:])]
    q_means, reduced = phase(second, 2, "phase2_s")
    energies = reduced[0].energies
    average = timed("phase2_s", lambda: low_rank_average(rounds[0], q_means[0], energies))
    for r, q in zip(rounds[1:], q_means[1:]):  # the other members finish theirs (their buffers' business)
        low_rank_average(r, q, energies)
    return average, [len(first[0]), len(second[0])], sum(sent)


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
    parser.add_argument("--repeats", type=int, default=3, help="rounds timed after the first, which is reported apart")
    parser.add_argument("--horizon", type=int, default=100, help="inner steps of the round the codecs are set beside")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the codecs (default: every core)")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the peak-memory run of each strategy (speed only)")
    parser.add_argument("--name", default="compression")
    parser.add_argument("--measure", nargs=2, metavar=("DELTA", "SETTINGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], json.loads(args.measure[1]), args.repeats)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        delta_path = make_delta(args, Path(tmp))
        step_s = step_seconds(args, Path(tmp))
        round_s = step_s * args.horizon
        results = {label: run_strategy(delta_path, settings, args) for label, settings in STRATEGIES.items()}
        for label, r in results.items():
            r["share_of_round"] = r["total_s"] / round_s
            memory = f"  peak +{r['transient_peak_fp32_copies']:.2f} copies" if args.memory else ""
            print(f"{label:40s} {r['message_bytes']:>10,d} B/message  x{r['ratio_vs_fp32_ring']:7.1f} vs fp32 ring  "
                  f"err {r['relative_error_first_round']:.3f}  codec {r['total_s']:.2f}s/round "
                  f"({100 * r['share_of_round']:.3g}% of a round of H={args.horizon}){memory}", flush=True)
    path = write_result(args.name, {
        "preset": args.preset, "stage": 0, "stages": args.stages, "device": args.device, "inner_steps": args.inner_steps,
        "group_size": GROUP, "inner_step_s": step_s, "horizon": args.horizon, "round_compute_s": round_s,
        "codec_threads": args.threads or os.cpu_count(), "strategies": results,
    })  # fmt: skip
    print(f"one inner step of the whole peer: {step_s:.3f}s, a round of H={args.horizon}: {round_s:.1f}s; wrote {path}")
    return 0


def run_strategy(delta_path: Path, settings: dict, args: argparse.Namespace) -> dict:
    """One strategy: its speed (the process's own allocator), then its memory (another process, one round, with
    glibc's mmap threshold fixed: every large block goes back to the OS when freed, so the peak resident memory is
    the peak of live memory, not of what glibc's heap kept around; freed blocks then come back as fresh pages, which
    makes that process 2-3x slower than a peer, so it is not timed)."""
    cmd = [sys.executable, __file__, "--measure", str(delta_path), json.dumps(settings)]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}

    def measured(extra: list[str], more_env: dict) -> dict:
        out = subprocess.run(cmd + extra, check=True, capture_output=True, text=True, env={**env, **more_env})
        return json.loads(out.stdout.strip().splitlines()[-1])

    result = {"settings": settings, **measured(["--repeats", str(args.repeats)], {})}
    memory_keys = ("transient_peak_fp32_copies",)
    for key in memory_keys:
        result.pop(key)
    if args.memory:
        memory = measured(["--repeats", "1"], {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})  # 2 rounds in all
        result.update({key: memory[key] for key in memory_keys})
    return result


if __name__ == "__main__":
    sys.exit(main())
