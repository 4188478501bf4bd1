#!/usr/bin/env python3
"""Does the one-step delay hide the exchange? Peers on shaped links, side by side in one run.

    sudo python benchmarks/overlap.py                 # 3 peers x 2 stages, tiny, 10 Mbit/s links
    sudo python benchmarks/overlap.py --helper-nice 0 -10 10 --repeats 3   # CPU priorities compared

Every peer runs in its own network namespace behind a `tc tbf` link (both directions;
netem is not available here, so there is bandwidth but no added latency). The same
swarm trains as `delayed` (DiLoCoX: the all-reduce of round t runs during round t+1),
`sync` (DiLoCo: each peer waits for it) and with averaging disabled (each peer alone,
`--no-swarm`: the upper bound). Throughput of a peer = tokens of rounds 1..R-2 over their
wall time: steady state, without round 0 (start-up) and the last round (in `delayed` it
also waits for its own average, a once-per-run drain). The target is delayed >= 0.95 x
disabled. H defaults to 100 inner steps per round (Streaming DiLoCo's setting);
`--inner-steps 20` is a communication-heavy stress case. Each stage trains on one thread.
`--helper-nice A B ...` runs `delayed` once per CPU priority of the swarm's helper
processes (swarm.helper_nice); `--repeats N` runs every variant N times, interleaved, and
takes each ratio against the `disabled` run of the same repeat (single runs on a shared
2-core machine move by several points). Writes benchmarks/results/<name>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, write_result  # noqa: E402
from benchmarks.netlab import NetLab  # noqa: E402
from benchmarks.netns.runner import run_peers  # noqa: E402
from dilocox_p2p.config import SwarmConfig, load_config  # noqa: E402

VARIANTS = ("disabled", "delayed", "sync")


def peer_cmd(args: argparse.Namespace, variant: str, nice: int, lab: NetLab, host: int, run_dir: Path) -> list[str]:
    cmd = [
        sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", f"overlap-{variant}", "--run-dir", str(run_dir),
        "--preset", args.preset, "--stages", str(args.stages), "--rounds", str(args.rounds),
        "--inner-steps", str(args.inner_steps), "--device", "cpu", "--progress", "lines", "--log-level", "warning",
        "--data-seed", str(host), "--host-maddrs", f"/ip4/{lab.ip(host)}/tcp/0", "--set", "inner.threads=1",
    ]
    if variant == "disabled":
        return [*cmd, "--no-swarm"]
    return [
        *cmd, "--mode", variant, "--min-peers", str(args.peers), "--round-wait", "30",
        "--set", f"swarm.helper_nice={nice}",
    ]


def run_variant(args: argparse.Namespace, variant: str, nice: int, name: str, tmp: Path) -> list[list[dict]]:
    dirs = [tmp / name / f"peer{host}" for host in range(args.peers)]
    run = run_peers(lambda lab, host: peer_cmd(args, variant, nice, lab, host, dirs[host]), peers=args.peers,
                    rate_mbit=args.rate_mbit, run_dirs=dirs, announces=variant != "disabled", timeout=args.timeout)  # fmt: skip
    return run.records


def variant_names(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(variant, helper_nice, name) for each run of one repeat: `disabled` once, `delayed` once per
    --helper-nice value, `sync` at the first value only (the priority question is about the overlap)."""
    runs = []
    for variant in args.variants:
        values = {"disabled": [0], "delayed": args.helper_nice, "sync": args.helper_nice[:1]}[variant]
        for nice in values:
            named = variant != "disabled" and len(args.helper_nice) > 1
            runs.append((variant, nice, f"{variant} (helper_nice {nice})" if named else variant))
    return runs


def summarize(records: list[list[dict]], tokens_per_round: int) -> dict:
    per_peer = []
    for recs in records:
        steady = recs[:-1]  # rounds 0..R-2; throughput over the boundaries of round 0 and round R-2
        span = steady[-1]["time"] - steady[0]["time"]
        per_peer.append(tokens_per_round * (len(steady) - 1) / span)
    waits = [r["seconds_comm_wait"] for recs in records for r in recs[1:-1]]
    return {
        "tokens_per_s": statistics.mean(per_peer),
        "tokens_per_s_per_peer": per_peer,
        "mean_seconds_comm_wait_per_round": statistics.mean(waits),
        "mean_bytes_sent_per_round": statistics.mean(r["bytes_sent"] for recs in records for r in recs),
        "final_val_loss": statistics.mean(recs[-1]["val_loss"] for recs in records),
        "final_hashes_equal": len({tuple(recs[-1]["stage_hashes"]) for recs in records}) == 1,
    }


def plot(ratios: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ratios)
    means = [statistics.mean(ratios[n]) for n in names]
    spread = [[m - min(ratios[n]) for n, m in zip(names, means)], [max(ratios[n]) - m for n, m in zip(names, means)]]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 3.8))
    colors = ["#999999" if n == "disabled" else "#2a7ab0" if n.startswith("delayed") else "#d9822b" for n in names]
    bars = ax.bar([n.replace(" (", "\n(") for n in names], means, color=colors, yerr=spread, capsize=4)
    for bar, mean in zip(bars, means):
        ax.text(bar.get_x() + bar.get_width() / 2, 0.02, f"{mean:.2f}x", ha="center", va="bottom", color="white")
    ax.axhline(0.95, color="#444444", linestyle="--", linewidth=0.8)
    ax.set_ylabel("tokens/s vs averaging disabled")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=8, help="at least 3 (steady state is rounds 1..R-2)")
    parser.add_argument("--inner-steps", type=int, default=100)
    parser.add_argument("--rate-mbit", type=float, default=10.0)
    parser.add_argument("--helper-nice", type=int, nargs="+", default=[SwarmConfig().helper_nice],
                        help="swarm.helper_nice for the averaging variants (default: the peers' default); "
                             "several values run each averaging variant once per value, side by side")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--keep", metavar="DIR", help="keep the peers' run dirs here (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every variant this many times, interleaved; ratios are taken within a repeat")
    parser.add_argument("--name", default="overlap", help="result file name under benchmarks/results/")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: throughput is measured over rounds 1..R-2")

    signal.signal(signal.SIGTERM, _exit_cleanly)  # the network lab is torn down on the way out
    cfg = load_config(overrides={"model.preset": args.preset, "model.stages": args.stages})
    tokens_per_round = args.inner_steps * cfg.inner.batch_size * cfg.model.shape.seq_len
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(args.keep or tmp).resolve()
        for repeat in range(args.repeats):  # interleaved: a slow spell of the machine hits every variant
            for variant, nice, name in variant_names(args):
                records = run_variant(args, variant, nice, name, Path(tmp) / f"repeat{repeat}")
                runs.setdefault(name, []).append(summarize(records, tokens_per_round))
                print(f"repeat {repeat + 1}/{args.repeats} {name:28s} {runs[name][-1]['tokens_per_s']:9,.0f} tokens/s "
                      f"per peer, wait {runs[name][-1]['mean_seconds_comm_wait_per_round']:.2f} s/round", flush=True)
    if "disabled" not in runs or len(runs) == 1:
        print(json.dumps(runs, indent=2))  # nothing to compare: no plot, no result file
        return 0
    # each run against the `disabled` run of the same repeat
    ratios = {n: [r["tokens_per_s"] / d["tokens_per_s"] for r, d in zip(rs, runs["disabled"])] for n, rs in runs.items()}
    summary = {n: {"mean": statistics.mean(v), "min": min(v), "max": max(v)} for n, v in ratios.items()}
    title = (f"{args.peers} peers x {args.stages} stages, {args.preset}, H={args.inner_steps}, "
             f"{args.rate_mbit:g} Mbit/s, {args.repeats} interleaved repeats (bars: mean, whiskers: min-max)")
    plot(ratios, RESULTS / f"{args.name}.png", title)
    path = write_result(args.name, {
        "config": vars(args),
        "link": f"tc tbf {args.rate_mbit} Mbit/s each way per peer, no added latency",
        "runs": runs,
        "ratio_to_disabled": ratios,
        "ratio_summary": summary,
        "target": "delayed >= 0.95 x disabled",
        "target_met": {n: v["mean"] >= 0.95 for n, v in summary.items() if n.startswith("delayed")},
    })
    print(json.dumps(summary, indent=2))
    print(path)
    return 0


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
