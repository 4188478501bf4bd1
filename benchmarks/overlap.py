#!/usr/bin/env python3
"""Does the one-step delay hide the exchange? Peers on shaped links, three ways, in one run.

    sudo python benchmarks/overlap.py                 # 3 peers x 2 stages, tiny, 10 Mbit/s links

Every peer runs in its own network namespace behind a `tc tbf` link (both directions;
netem is not available here, so there is bandwidth but no added latency). The same
swarm trains three times: `delayed` (DiLoCoX: the all-reduce of round t runs during
round t+1), `sync` (DiLoCo: each peer waits for it) and averaging disabled (each peer
alone, `--no-swarm`: the upper bound). Throughput of a peer = tokens of rounds 1..R-2
over their wall time: steady state, without round 0 (start-up) and the last round (in
`delayed` it also waits for its own average, a once-per-run drain). The target is
delayed >= 0.95 x disabled. H defaults to 100 inner steps per round (Streaming DiLoCo's
setting); `--inner-steps 20` is a communication-heavy stress case. Each stage trains
on one thread and the swarm's helper processes run below training (`--helper-nice 10`).
Writes benchmarks/results/<name>.json and <name>.png (default name: overlap).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, write_result  # noqa: E402
from benchmarks.netlab import NetLab  # noqa: E402
from dilocox_p2p.launch import wait_for_multiaddrs  # noqa: E402

VARIANTS = ("disabled", "delayed", "sync")


def peer_cmd(args: argparse.Namespace, variant: str, lab: NetLab, host: int, run_dir: Path) -> list[str]:
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
        "--set", f"swarm.helper_nice={args.helper_nice}",
    ]


def run_variant(args: argparse.Namespace, variant: str, tmp: Path) -> list[list[dict]]:
    with NetLab(args.peers, args.rate_mbit) as lab:
        procs, logs = [], []
        for host in range(args.peers):
            run_dir = tmp / variant / f"peer{host}"
            run_dir.mkdir(parents=True)
            cmd = peer_cmd(args, variant, lab, host, run_dir)
            if host > 0 and variant != "disabled":
                cmd += ["--initial-peers", _first_maddr(tmp / variant / "peer0", procs[0])]
            logs.append(open(run_dir.parent / f"peer{host}.out", "w"))
            procs.append(lab.popen(host, cmd, stdout=logs[-1], stderr=subprocess.STDOUT))
        for host, proc in enumerate(procs):
            if proc.wait(args.timeout) != 0:
                raise SystemExit(f"{variant} peer{host} failed:\n{(tmp / variant / f'peer{host}.out').read_text()[-3000:]}")
    return [
        [json.loads(line) for line in (tmp / variant / f"peer{h}" / "metrics.jsonl").read_text().splitlines()]
        for h in range(args.peers)
    ]


def _first_maddr(run_dir: Path, proc: subprocess.Popen) -> str:
    return wait_for_multiaddrs(run_dir, alive=lambda: proc.poll() is None)[0]


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


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    names = list(results)
    values = [results[n]["tokens_per_s"] for n in names]
    bars = ax.bar(names, values, color=["#999999", "#2a7ab0", "#d9822b"])
    for bar, name in zip(bars, names):
        ratio = results[name]["tokens_per_s"] / results["disabled"]["tokens_per_s"]
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{ratio:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("tokens/s per peer")
    ax.set_title("averaging disabled vs delayed (DiLoCoX) vs sync (DiLoCo)")
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
    parser.add_argument("--helper-nice", type=int, default=10,
                        help="swarm.helper_nice for the averaging variants; 10: the helpers take only idle CPU "
                             "(one torch thread per stage leaves some); the peers' default is -10")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--keep", metavar="DIR", help="keep the peers' run dirs here (default: a temp dir)")
    parser.add_argument("--name", default="overlap", help="result file name under benchmarks/results/")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3: throughput is measured over rounds 1..R-2")
    from dilocox_p2p.config import load_config

    cfg = load_config(overrides={"model.preset": args.preset, "model.stages": args.stages})
    tokens_per_round = args.inner_steps * cfg.inner.batch_size * cfg.model.shape.seq_len
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or tmp
        for variant in args.variants:
            results[variant] = summarize(run_variant(args, variant, Path(tmp)), tokens_per_round)
            print(f"{variant:9s} {results[variant]['tokens_per_s']:9,.0f} tokens/s per peer, "
                  f"wait {results[variant]['mean_seconds_comm_wait_per_round']:.2f} s/round", flush=True)
    if "disabled" not in results or len(results) == 1:
        print(json.dumps(results, indent=2))  # nothing to compare: no plot, no result file
        return 0
    base = results["disabled"]["tokens_per_s"]
    ratios = {v: results[v]["tokens_per_s"] / base for v in results}
    plot(results, RESULTS / f"{args.name}.png")
    path = write_result(args.name, {
        "config": vars(args),
        "link": f"tc tbf {args.rate_mbit} Mbit/s each way per peer, no added latency",
        "results": results,
        "ratio_to_disabled": ratios,
        "target": "delayed >= 0.95 x disabled",
        "target_met": ratios["delayed"] >= 0.95 if "delayed" in ratios else None,
    })
    print(json.dumps(ratios, indent=2))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
