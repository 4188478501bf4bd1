#!/usr/bin/env python3
"""Bytes per member and round against the group size, counted and on the wire (needs root).

    sudo .venv/bin/python benchmarks/butterfly_bytes.py                      # N = 3, 4, 6, 8; int8, fp4, lowrank
    sudo .venv/bin/python benchmarks/butterfly_bytes.py --peers 3 4 --kinds int8 --rounds 4
    sudo .venv/bin/python benchmarks/butterfly_bytes.py --peers 4 --set swarm.reuse_groups=false   # matchmaking always

For each compression kind and group size N, N peers of the `tiny` preset (1 pipeline stage, `--mode sync`) train
in their own network namespaces behind `tc tbf` links (benchmarks/netlab.py) for --rounds rounds of H=--inner-steps.
Peer 0 runs with ATEN_CPU_CAPABILITY=default and every other peer with 2 inner threads instead of 1, so the run
also checks that theta_g stays bit-identical across instruction sets and thread counts (equal hashes).

Per run, over the steady rounds (1 .. R-2, every member averaged in one group of N):
- message: the bytes of one member's message of that kind for that stage (encoded here by the project's codec;
  low-rank at a fixed rank, compression.energy_target=0, phase 1 and phase 2 together);
- counted: the bytes each member's records say it sent and received for the exchange (metrics.jsonl);
- ideal: 2 (N-1)/N x the message (a butterfly or ring), and the all-gather's (N-1) x the message;
- wire: what crossed each member's interface per round, both directions (veth counters), and the part of it
  that is not the counted exchange (DHT, matchmaking, signed requests, phase 5, framing, TCP/IP headers);
- the ratio of the wire bytes to an fp32 ring all-reduce of the stage;
- metered: what the peers' own `wire_bytes` records say their p2p daemons moved per round (every kind of
  traffic, TCP payload: swarm/wire_meter.py), and its share of the interface's bytes;
- time: an exchange's seconds (metrics.jsonl `exchange_phases`, its `wait` for slower members left out), its
  fixed cost (those seconds minus its counted bytes at the link's rate: what is not moving the message) and
  the median of each phase, and of each phase the median spread of the members' ends (`exchange_phase_ends`):
  how long the first to end a step waited there for the last.
Writes benchmarks/results/<name>.json, .md and .png. Quantized kinds and top-k ride the compressed butterfly
(compression/butterfly.py), low-rank both its phases; `topk:butterfly` and `topk:gather` set
compression.topk_transport, side by side (`topk` alone: its default, auto).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402

from benchmarks.common import RESULTS, write_result  # noqa: E402
from benchmarks.netlab import NetLabError, check_available  # noqa: E402
from benchmarks.netns.runner import GLOO_ON_LAB_LINK, run_peers  # noqa: E402

KINDS = ("int8", "fp4", "lowrank")


def stage_shapes(preset: str) -> list[torch.Size]:
    from dilocox_p2p.config import PRESETS
    from dilocox_p2p.model import build_stage

    return [p.shape for p in build_stage(PRESETS[preset], 1, 0, seed=0).parameters()]


def message_bytes(kind: str, shapes: list[torch.Size]) -> int:
    """One member's message (both phases for low-rank) for a stage of `shapes`, by the project's codec."""
    from dilocox_p2p.compression.codec import StageCodec
    from dilocox_p2p.config import CompressionConfig

    cfg = CompressionConfig(kind=kind.partition(":")[0], energy_target=0.0)
    names = [f"t{i}" for i in range(len(shapes))]
    gen = torch.Generator().manual_seed(0)
    codec = StageCodec(cfg, names, shapes, run_id="bytes")
    rc = codec.begin(0, [torch.randn(s, generator=gen) * 1e-3 for s in shapes])
    first = rc.message(1)
    return len(first) + (len(rc.message(2, [first])) if codec.phases == 2 else 0)


def peer_cmd(args: argparse.Namespace, kind: str, n: int, host: int, ip: str, run_dir: Path) -> list[str]:
    kind, _, transport = kind.partition(":")
    cmd = [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", f"bytes-{kind}{transport and '-' + transport}-{n}", "--run-dir", str(run_dir),
           "--preset", args.preset, "--stages", "1", "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps),
           "--batch-size", str(args.batch_size), "--mode", "sync", "--compression", kind, "--min-peers", str(n),
           "--checkpoint-every", str(args.rounds),  # the last round's only: what is measured is bytes
           "--device", "cpu", "--progress", "lines", "--log-level", "warning", "--data-seed", str(host),
           "--host-maddrs", f"/ip4/{ip}/tcp/0", "--round-wait", "60", "--set", "swarm.allreduce_timeout=300",
           "--set", "swarm.chunk_timeout=60", "--set", f"inner.threads={1 if host % 2 == 0 else 2}"]  # fmt: skip
    if kind == "lowrank":
        cmd += ["--set", "compression.energy_target=0"]
    if transport:
        cmd += ["--set", f"compression.topk_transport={transport}"]
    for override in args.set:
        cmd += ["--set", override]
    return cmd


def measure(args: argparse.Namespace, kind: str, n: int, message: int, fp32_ring: float, tmp: Path) -> dict:
    dirs = [tmp / f"{kind}-{n}" / f"peer{h}" for h in range(n)]
    env = {**GLOO_ON_LAB_LINK}
    run = run_peers(lambda lab, host: _with_capability(peer_cmd(args, kind, n, host, lab.ip(host), dirs[host]), host),
                    peers=n, rate_mbit=args.rate, run_dirs=dirs, announces=True, timeout=args.timeout, env=env)  # fmt: skip
    steady = range(1, args.rounds - 1)
    sent, received, wire, full = [], [], [], True
    exchange, fixed, phases, metered, reused, shares = [], [], {}, [], [], []
    by_member: list[dict[str, list[float]]] = []  # per member, its seconds of each phase over the steady rounds
    by_source: dict[str, list[float]] = {}  # per direction and steady round of a member (swarm/protocol_bytes.py)
    for host, records in enumerate(run.records):
        by_round = {r["round"]: r for r in records}
        by_member.append({})
        for t in steady:
            r = by_round.get(t)
            if r is None or r["group_sizes"] != [n] or r["kinds"] != ["averaged"]:
                full = False
                continue
            sent.append(r["bytes_sent"])
            shares.append((r.get("counted_shares") or [None])[0])
            reused.append(bool((r.get("groups_reused") or [False])[0]))
            received.append(r["bytes_received"])
            clock = (r.get("exchange_phases") or [None])[0] or {}
            seconds = sum(v for k, v in clock.items() if k != "wait")  # the members' own pace left out
            exchange.append(seconds)
            fixed.append(seconds - max(r["bytes_sent"], r["bytes_received"]) * 8 / (args.rate * 1e6))
            for k, v in clock.items():
                phases.setdefault(k, []).append(v)
                by_member[-1].setdefault(k, []).append(v)
            if r.get("wire_bytes") and r["wire_bytes"][0] is not None:
                metered.append(sum(r["wire_bytes"][0]) / 2)  # per direction, as `wire`
            for source, moved in ((r.get("wire_by_source") or [None])[0] or {}).items():
                by_source.setdefault(source, []).append(sum(moved) / 2)
        ends = [by_round[t]["time"] for t in (steady.start - 1, steady.stop - 1) if t in by_round]
        if len(ends) == 2:
            rx, tx = run.wire(host, ends[0], ends[1])
            wire.append((rx + tx) / 2 / len(steady))  # per direction and round
    spreads = end_spreads(run.records, steady)
    hashes = {tuple(r["stage_hashes"]) for records in run.records for r in records if r["round"] == args.rounds - 1}
    shutil.rmtree(tmp / f"{kind}-{n}", ignore_errors=True)  # checkpoints: a `small` peer's is 0.7 GB
    counted = statistics.median(sent) if sent else None
    ideal = 2 * (n - 1) / n * message
    wire_per_round = statistics.median(wire) if wire else None
    return {
        "kind": kind, "peers": n, "message_bytes": message, "all_gather_bytes": (n - 1) * message,
        "butterfly_bytes": ideal, "counted_sent": counted,
        "counted_received": statistics.median(received) if received else None,
        "counted_vs_butterfly": counted / ideal if counted else None,
        "wire_bytes_per_direction": wire_per_round,
        "wire_vs_butterfly": wire_per_round / ideal if wire_per_round else None,
        "wire_not_counted": wire_per_round - counted if wire_per_round and counted else None,
        "wire_vs_fp32_ring": wire_per_round / fp32_ring if wire_per_round else None,
        "counted_vs_fp32_ring": counted / fp32_ring if counted else None,
        "every_steady_round_full": full, "hashes_equal": len(hashes) == 1, "seconds": run.seconds,
        "groups_reused_share": sum(reused) / len(reused) if reused else None,
        # the least share of a member's message a steady round's average counted (1.0: every message whole)
        "counted_share_min": min(shares) if shares and None not in shares else None,
        "exchange_s": statistics.median(exchange) if exchange else None,
        "fixed_s": statistics.median(fixed) if fixed else None,
        "phases_median_s": {k: round(statistics.median(v), 3) for k, v in phases.items()},
        # each member's medians: a phase that one member spends waiting for the others (skew) shows here
        "phases_median_s_by_member": [{k: round(statistics.median(v), 3) for k, v in m.items()} for m in by_member],
        # per phase, the median over the steady rounds of the time between the first and the last member's end of it
        "phase_end_spread_median_s": spreads,
        "wire_metered_per_direction": statistics.median(metered) if metered else None,
        "metered_vs_wire": statistics.median(metered) / wire_per_round if metered and wire_per_round else None,
        "sources_per_direction": sources_per_direction(by_source, len(sent), metered, wire_per_round),
    }  # fmt: skip


def end_spreads(records: list[list[dict]], rounds: range) -> dict[str, float]:
    """Per phase, the median over `rounds` of the seconds between the first and the last member's end of it
    (metrics.jsonl `exchange_phase_ends`, stage 0; the lab's members share one clock): how long the first to
    end a step waited there for the last. A round counts for a phase where every member recorded it."""
    by_phase: dict[str, list[float]] = {}
    for t in rounds:
        ends = []
        for member in records:
            r = next((r for r in member if r["round"] == t), None)
            ends.append(((r or {}).get("exchange_phase_ends") or [None])[0] or {})
        for phase in ends[0] if ends else ():
            if all(phase in e for e in ends):
                times = [e[phase] for e in ends]
                by_phase.setdefault(phase, []).append(max(times) - min(times))
    return {phase: round(statistics.median(v), 3) for phase, v in by_phase.items()}


def sources_per_direction(by_source: dict[str, list[float]], member_rounds: int, metered: list[float],
                          wire: float | None) -> dict[str, float]:
    """What a member's bytes per direction and round were for: each source's mean over the steady rounds of every
    member (a round where a source moved nothing counts as 0), `libp2p` the metered bytes less the messages (the
    daemon's framing, encryption, negotiation, pings), `tcp/ip` the interface's bytes less the metered (headers,
    pure acknowledgements)."""
    if not member_rounds:
        return {}
    out = {s: sum(v) / member_rounds for s, v in sorted(by_source.items()) if s != "own_stages"}
    if metered:
        out["libp2p"] = statistics.mean(metered) - sum(out.values())
        if wire:
            out["tcp/ip"] = wire - statistics.mean(metered)
    return {s: round(v) for s, v in out.items()}


def _with_capability(cmd: list[str], host: int) -> list[str]:
    """Peer 0 computes without AVX (ATEN_CPU_CAPABILITY=default): its theta_g must still match the others'."""
    return ["env", "ATEN_CPU_CAPABILITY=default", *cmd] if host == 0 else cmd


def write_all(args: argparse.Namespace, params: int, rows: list[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out / f"{args.name}.png", args.preset)
    (args.out / f"{args.name}.md").write_text(table(rows))
    write_result(args.name, {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                             "params": params, "rows": rows, "plot": f"{args.name}.png"}, directory=args.out)  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| kind | N | message | counted sent / 2(N-1)/N | all-gather would send | wire per direction / 2(N-1)/N | "
             "wire not counted | of which (per direction) | wire vs fp32 ring | exchange s | fixed s | hashes equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        fmt = lambda v, f, unit="": "-" if v is None else format(v, f) + unit  # noqa: E731
        lines.append(f"| {r['kind']} | {r['peers']} | {r['message_bytes']:,} B | {fmt(r['counted_vs_butterfly'], '.3f')} | "
                     f"{r['all_gather_bytes'] / r['butterfly_bytes']:.2f}x | {fmt(r['wire_vs_butterfly'], '.2f')} | "
                     f"{fmt(r['wire_not_counted'], ',.0f', ' B')} | {_not_counted(r)} | {fmt(r['wire_vs_fp32_ring'], '.4f')} | "
                     f"{fmt(r.get('exchange_s'), '.3f')} | {fmt(r.get('fixed_s'), '.3f')} | {r['hashes_equal']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _not_counted(row: dict) -> str:
    """The sources beside the exchange's payload, largest first, in kB (the exchange's own signed requests and framing:
    its source's bytes less the counted payload)."""
    sources = dict(row.get("sources_per_direction") or {})
    if not sources:
        return "-"
    if "exchange" in sources and row.get("counted_sent"):
        sources["exchange"] -= (row["counted_sent"] + (row.get("counted_received") or row["counted_sent"])) / 2
    return ", ".join(f"{s} {v / 1e3:.0f}k" for s, v in sorted(sources.items(), key=lambda x: -x[1]) if abs(v) >= 500)


def plot(rows: list[dict], path: Path, preset: str = "tiny") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind and r["counted_sent"]]
        ns = [r["peers"] for r in mine]
        line, = ax.plot(ns, [r["counted_sent"] / r["message_bytes"] for r in mine], "o-", label=f"{kind}: counted")
        ax.plot(ns, [r["wire_bytes_per_direction"] / r["message_bytes"] for r in mine if r["wire_bytes_per_direction"]],
                "s--", color=line.get_color(), alpha=0.6, label=f"{kind}: on the wire")  # fmt: skip
    ns = sorted({r["peers"] for r in rows})
    ax.plot(ns, [2 * (n - 1) / n for n in ns], "k:", label="2(N-1)/N (butterfly)")
    ax.plot(ns, [n - 1 for n in ns], "k-.", alpha=0.5, label="N-1 (all-gather)")
    ax.set(xlabel="group size N", ylabel="bytes sent per member and round / message", yscale="log",
           title=f"bytes per member against the group size ({preset}, 1 stage)")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, nargs="+", default=[3, 4, 6, 8], help="group sizes")
    p.add_argument("--kinds", nargs="+", default=list(KINDS),
                   choices=["fp16", *KINDS, "topk", "topk:butterfly", "topk:gather"],
                   help="topk: its default transport (auto: all-gathered in groups of up to 3, the butterfly from 4); "
                        "topk:butterfly, topk:gather: that transport at every N")  # fmt: skip
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rounds", type=int, default=5, help="rounds per run (steady: 1 .. R-2)")
    p.add_argument("--inner-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rate", type=float, default=100.0, help="lab link rate, Mbit/s (both directions)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one run may take")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every peer, repeatable (swarm.reuse_groups=false: every round's group "
                        "found by matchmaking)")  # fmt: skip
    p.add_argument("--name", default="butterfly_bytes")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    try:
        check_available()
    except NetLabError as e:
        print(f"butterfly_bytes: {e}", file=sys.stderr)
        return 2
    shapes = stage_shapes(args.preset)
    params = sum(s.numel() for s in shapes)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dilocox-bytes-") as tmp:
        for kind in args.kinds:
            message = message_bytes(kind, shapes)
            for n in args.peers:
                fp32_ring = 2 * (n - 1) / n * 4 * params
                row = measure(args, kind, n, message, fp32_ring, Path(tmp))
                rows.append(row)
                print(f"[bytes] {kind} N={n}: counted {row['counted_vs_butterfly']} x 2(N-1)/N, wire "
                      f"{row['wire_vs_butterfly']} x, {row['wire_vs_fp32_ring']} x fp32 ring, metered {row['metered_vs_wire']} "
                      f"x the interface's, exchange "
                      f"{row['exchange_s']} s, fixed {row['fixed_s']} s {row['phases_median_s']}, members' ends apart "
                      f"{row['phase_end_spread_median_s']}, groups reused "
                      f"{row['groups_reused_share']}, least share counted {row['counted_share_min']}, hashes equal "
                      f"{row['hashes_equal']} ({row['seconds']:.0f} s)", flush=True)  # fmt: skip
                write_all(args, params, rows)  # after every run: a run that fails later keeps what was measured
    print(table(rows))
    return 0 if all(r["hashes_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
