"""The exchange alone: seconds for our all-reduce of a fixed pseudo-gradient against the ideal ring time.

    python -m benchmarks.netns.allreduce --host 0 --peers 4 --ip 10.1.0.1 --leader-ip 10.1.0.1 --dir D
    (one process per peer, started in its namespace by benchmarks.netns, which calls `measure`)

Each peer builds the project's real SwarmStage (DHT node, signed records, membership, averager, codecs:
what a stage worker of `join` builds) around a synthetic pseudo-gradient with the shapes of a preset's
stage (default: `small`, stage 0 of 2, 13.0M values, as benchmarks/compression.py), N(0, 1e-3) drawn per
peer, and runs rounds of `SwarmStage.all_reduce` (the Averager protocol the outer loop calls) with no
trainer: fp32 (`none`, the exact butterfly) and each compression (through the compressed butterfly:
allreduce.sends_per_message says what each sends), then a gloo all_reduce of the same fp32 vector as a reference. One warm-up
round, then `repeats` timed ones. A round's time runs from the moment the last member has started it
(window start, after the wait for the others) to the moment the last member holds the average: it
includes matchmaking, encoding and decoding. The ideal is the bandwidth-optimal ring all-reduce of the
same payload (fp32: 4 bytes x values; compressed: one member's message(s)): 2 (N-1)/N x payload / rate.
An all-gather cannot reach it: each member sends its payload N-1 times, (N-1) x payload / rate at best, N/2
times the ring (2x at N = 4); that bound is reported beside it (`algorithm_ideal_seconds`).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.netns.gpu import ring_seconds  # noqa: E402
from benchmarks.netns.runner import GLOO_ON_LAB_LINK, run_peers  # noqa: E402

__all__ = ["STRATEGIES", "measure"]

STRATEGIES = ("none", "fp16", "int8", "fp4", "lowrank", "topk")
GLOO_PORT = 29512


def _tensors(args: argparse.Namespace) -> tuple[list[torch.Tensor], list[str]]:
    from dilocox_p2p.config import PRESETS
    from dilocox_p2p.model import build_stage

    module = build_stage(PRESETS[args.preset], args.stages, 0, seed=0)
    gen = torch.Generator().manual_seed(1000 + args.host)
    named = list(module.named_parameters())
    return [torch.randn(p.shape, generator=gen).mul_(1e-3) for _, p in named], [n for n, _ in named]


def _exchange_rounds(args: argparse.Namespace, kind: str, tensors: list[torch.Tensor], names: list[str]) -> list[dict]:
    from dilocox_p2p.config import load_config
    from dilocox_p2p.endpoints import write_atomically
    from dilocox_p2p.launch import wait_for_multiaddrs
    from dilocox_p2p.swarm.stage import SwarmStage

    run_dir, meet = args.dir / f"peer{args.host}" / kind, args.dir / kind
    cfg = load_config(overrides={
        "run.run_id": f"netns-ar-{kind}", "run.run_dir": str(run_dir), "model.preset": args.preset,
        "model.stages": args.stages, "compression.kind": kind, "swarm.host_maddrs": [f"/ip4/{args.ip}/tcp/0"],
        "swarm.round_wait": 60.0, "swarm.allreduce_timeout": args.timeout, "swarm.chunk_timeout": 60.0,
    })  # fmt: skip
    leader = [] if args.host == 0 else wait_for_multiaddrs(meet, alive=lambda: True, timeout=args.timeout)[:1]
    stage = SwarmStage(cfg, stage=0, tensors=tensors, names=names, run_dir=run_dir,
                       peer_name=f"netns-ar-{args.host}", extra_peers=leader)  # fmt: skip
    try:
        if args.host == 0:
            meet.mkdir(parents=True, exist_ok=True)
            write_atomically(meet / "multiaddrs.txt", "\n".join(stage.maddrs()) + "\n")
        stage.start()
        stage.heartbeat.update(boundary=0)  # at the start barrier, as a worker says it (swarm/worker.py)
        stage.membership.wait_for_peers(args.peers, timeout=args.timeout)
        stage.set_state(0, ready=False, training=True)  # the others wait for this member in every round
        _wait_for_training(stage, args.peers, timeout=args.timeout)
        rows = []
        for r in range(args.repeats + 1):
            average = stage.all_reduce([t.clone() for t in tensors], round=r).result(timeout=3 * args.timeout)
            start, end = average.window or (float("nan"), float("nan"))
            rows.append({"strategy": kind, "round": r, "start": start, "end": end, "kind": average.kind.value,
                         "group_size": average.group_size, "bytes_sent": average.bytes_sent,
                         "bytes_received": average.bytes_received})  # fmt: skip
        return rows
    finally:
        stage.close()


def _wait_for_training(stage, count: int, *, timeout: float) -> None:
    """Until every member says it trains: a round started before would find the others not yet expected."""
    deadline = time.monotonic() + timeout
    while len(stage.membership.members(training_only=True, others_only=False)) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"fewer than {count} members of the exchange were ready within {timeout:.0f}s")
        time.sleep(0.5)
        stage.membership.refresh()


def _gloo_rounds(args: argparse.Namespace, numel: int) -> list[dict]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.leader_ip}:{GLOO_PORT}", rank=args.host,
                            world_size=args.peers, timeout=timedelta(seconds=args.timeout))  # fmt: skip
    vector = torch.randn(numel, generator=torch.Generator().manual_seed(args.host))
    rows = []
    for r in range(args.repeats + 1):
        dist.barrier()
        start = time.time()
        dist.all_reduce(vector)
        rows.append({"strategy": "gloo-fp32", "round": r, "start": start, "end": time.time(), "kind": "averaged",
                     "group_size": args.peers, "bytes_sent": None, "bytes_received": None})  # fmt: skip
    dist.destroy_process_group()
    return rows


def worker(argv: list[str] | None = None) -> int:
    """One peer: every strategy in turn (a fresh SwarmStage and run id each), then gloo; rows to DIR/peer<h>.jsonl."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    tensors, names = _tensors(args)
    out = args.dir / f"peer{args.host}.jsonl"
    for kind in args.strategies:
        rows = _gloo_rounds(args, sum(t.numel() for t in tensors)) if kind == "gloo" else _exchange_rounds(
            args, kind, tensors, names)  # fmt: skip
        with open(out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", type=int, required=True)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--ip", required=True, help="this peer's address (its namespace's eth0)")
    parser.add_argument("--leader-ip", required=True, help="peer 0's address (gloo's tcp:// rendezvous)")
    parser.add_argument("--dir", type=Path, required=True, help="shared directory: where peer 0 announces, rows go")
    parser.add_argument("--strategies", nargs="+", default=[*STRATEGIES, "gloo"], choices=[*STRATEGIES, "gloo"])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--preset", default="small", help="the pseudo-gradient has the shapes of this preset's stage 0")
    parser.add_argument("--stages", type=int, default=2, help="... split into this many stages")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one exchange may take")
    return parser


def measure(
    *, peers: int, rate_mbit: float, preset: str, stages: int, strategies: list[str], repeats: int, tmp: Path,
    exchange_timeout: float, timeout: float,
) -> list[dict]:
    """Run the workers in a fresh lab at `rate_mbit` (all of it within `timeout` s); one row per strategy."""
    tmp.mkdir(parents=True, exist_ok=True)

    def cmd(lab, host: int) -> list[str]:
        return [sys.executable, "-m", "benchmarks.netns.allreduce", "--host", str(host), "--peers", str(peers),
                "--ip", lab.ip(host), "--leader-ip", lab.ip(0), "--dir", str(tmp), "--strategies", *strategies,
                "--repeats", str(repeats), "--preset", preset, "--stages", str(stages),
                "--timeout", str(exchange_timeout)]  # fmt: skip

    run_peers(cmd, peers=peers, rate_mbit=rate_mbit, run_dirs=[tmp / f"peer{h}" for h in range(peers)],
              announces=False, timeout=timeout, env=GLOO_ON_LAB_LINK)  # fmt: skip
    rows = [json.loads(line) for h in range(peers) for line in (tmp / f"peer{h}.jsonl").read_text().splitlines()]
    return summarize(rows, peers=peers, rate_mbit=rate_mbit, numel=_numel(preset, stages))


def _numel(preset: str, stages: int) -> int:
    from dilocox_p2p.config import PRESETS
    from dilocox_p2p.model import stage_layout, unit_param_counts

    counts = unit_param_counts(PRESETS[preset])
    return sum(counts[i] for i in stage_layout(PRESETS[preset], stages)[0])


def sends_per_message(strategy: str, peers: int) -> float:
    """How many of its own messages a member sends in an exchange of `strategy` (as join's defaults run it): the
    exact and the compressed butterfly move a ring's 2(N-1)/N (low-rank: of its two messages); top-k through the
    butterfly (N-1)/N (1 + m), its reducers keeping m k values a chunk; all-gathered, N-1 copies."""
    from dilocox_p2p.compression.transport import rides_butterfly
    from dilocox_p2p.config import load_config

    ring = 2 * (peers - 1) / peers
    if strategy in ("none", "gloo-fp32", "lowrank"):
        return ring
    cfg = load_config(overrides={"compression.kind": strategy}).compression
    if not rides_butterfly(cfg, peers):
        return peers - 1
    if strategy == "topk":
        return (peers - 1) / peers * (1 + cfg.topk_reduced_multiple)
    return ring


def summarize(rows: list[dict], *, peers: int, rate_mbit: float, numel: int) -> list[dict]:
    """Per strategy: median seconds of the timed rounds, payload, the ideal ring time for it, and the ratio."""
    out = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy]
        timed = sorted({r["round"] for r in mine} - {0})
        seconds = [max(r["end"] for r in mine if r["round"] == t) - max(r["start"] for r in mine if r["round"] == t)
                   for t in timed]  # fmt: skip
        sent = [r["bytes_sent"] for r in mine if r["round"] in timed and r["bytes_sent"] is not None]
        fp32 = strategy in ("none", "gloo-fp32")
        # compressed: the payload is one member's message(s), what it sent divided by how often its algorithm sends them
        payload = 4 * numel if fp32 else statistics.median(sent) / sends_per_message(strategy, peers)
        ideal = ring_seconds(payload, peers, rate_mbit)
        # what the algorithm itself needs at best: its bytes through the member's link (the butterfly's are a ring's)
        own = ideal if fp32 else statistics.median(sent) * 8 / (rate_mbit * 1e6)
        out.append({
            "strategy": strategy, "values": numel, "payload_bytes": payload,
            "bytes_sent_per_peer": statistics.median(sent) if sent else None,
            "seconds": statistics.median(seconds), "seconds_each": seconds, "ideal_ring_seconds": ideal,
            "vs_ideal": statistics.median(seconds) / ideal, "algorithm_ideal_seconds": own,
            "vs_algorithm_ideal": statistics.median(seconds) / own, "rate_mbit": rate_mbit,
            "kinds": sorted({r["kind"] for r in mine if r["round"] in timed}),
            "group_sizes": sorted({r["group_size"] for r in mine if r["round"] in timed}),
        })  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(worker())
