#!/usr/bin/env python3
"""Which outer mode reaches a loss first on a slow link? Every mode's real swarm, side by side in one run.

    sudo python benchmarks/modes.py                    # 3 peers x 1 stage, tiny, H=20, 12 rounds, 100 and 2 Mbit/s
    sudo python benchmarks/modes.py --rates 100 --modes sync streaming-p2 --rounds 4 --name modes_smoke

Every peer runs `dilocox-peer join` in its own network namespace behind a `tc tbf` link (both
directions; netem is not available here, so bandwidth but no added latency). Each mode trains
the same tokens per peer (rounds x H x batch x seq); streaming runs P sync rounds of H/P steps
per round. Each mode runs at its tuned outer lr and momentum: the best of the equal-token sweep
of benchmarks/convergence.py (the project's own outer loop and codecs, the network left out),
read from --quality (default benchmarks/results/modes_quality.json; the mode's defaults where a
mode is missing there). Per mode and link it reports: the final val loss of theta_g (the shared
model), wall time, time to a fixed loss (the worst final loss of the link's runs, so that every
mode reaches it), the share of the run spent waiting for averages, bytes sent per sync, and the
peak bytes/s of one sync (bytes sent and received over its exchange window, summed over stages).
On a shaped link every transfer runs at the link's rate while it lasts, so peak bytes/s shows
the link more than the mode: the bytes per sync show streaming's P-fold cut. Writes
benchmarks/results/<name>.json and .png (val loss vs wall time, one panel per link).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, write_result  # noqa: E402
from benchmarks.netlab import NetLab  # noqa: E402
from benchmarks.netns.runner import run_peers  # noqa: E402
from dilocox_p2p.config import OuterConfig  # noqa: E402

TAU = 5  # streaming's overlap steps here, as in convergence.py's sweep
# mode name -> (join flags, the convergence.py configuration whose best lr/momentum it runs at)
MODES: dict[str, tuple[list[str], str]] = {
    "sync": (["--mode", "sync"], "sync fp32"),
    "delayed": (["--mode", "delayed"], "delayed fp32"),
    "eager": (["--mode", "eager"], "eager fp32"),
    "own": (["--mode", "own"], "own fp32"),
    "streaming-p1": (["--mode", "streaming", "--overlap-steps", str(TAU)], "streaming P1 fp32"),
    "streaming-p2": (["--mode", "streaming", "--fragments", "2", "--overlap-steps", str(TAU)], "streaming P2 fp32"),
    "streaming-p2-fp4": (
        ["--mode", "streaming", "--fragments", "2", "--overlap-steps", str(TAU), "--compression", "fp4"],
        "streaming P2 fp4",
    ),
    "sync-fp4": (["--mode", "sync", "--compression", "fp4"], "sync fp32"),
}


def tuned(quality: dict, mode: str) -> tuple[float, float, str]:
    """(outer lr, momentum, where they come from) for `mode`."""
    flags, label = MODES[mode]
    best = quality.get("results", {}).get(label, {}).get("best")
    if best is not None:
        return best["outer_lr"], best["outer_momentum"], f"best of convergence.py's sweep ({label})"
    cfg = OuterConfig(mode=flags[1])
    return cfg.effective_lr, cfg.effective_momentum, "the mode's defaults (not in the sweep's results)"


def peer_cmd(args: argparse.Namespace, mode: str, lr: float, momentum: float, lab: NetLab, host: int, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", f"modes-{mode}", "--run-dir", str(run_dir),
        "--preset", args.preset, "--stages", str(args.stages), "--rounds", str(args.rounds),
        "--inner-steps", str(args.inner_steps), "--batch-size", str(args.batch_size), "--device", "cpu",
        "--progress", "lines", "--log-level", "warning", "--data-seed", str(host),
        "--host-maddrs", f"/ip4/{lab.ip(host)}/tcp/0", "--set", "inner.threads=1", "--min-peers", str(args.peers),
        "--round-wait", "60", "--set", "swarm.allreduce_timeout=300", "--set", "swarm.chunk_timeout=60",
        "--outer-lr", str(lr), "--set", f"outer.momentum={momentum}", "--set", f"inner.warmup_steps={args.warmup}",
        "--compression", "none", *MODES[mode][0],  # fp32 unless the mode names its compression
    ]  # fmt: skip


def run_mode(args: argparse.Namespace, mode: str, rate: float, lr: float, momentum: float, tmp: Path) -> list[list[dict]]:
    dirs = [tmp / f"{mode}@{rate:g}" / f"peer{host}" for host in range(args.peers)]
    run = run_peers(lambda lab, host: peer_cmd(args, mode, lr, momentum, lab, host, dirs[host]), peers=args.peers,
                    rate_mbit=rate, run_dirs=dirs, announces=True, timeout=args.timeout)  # fmt: skip
    return run.records


def curve(records: list[dict], syncs: int) -> list[tuple[float, float]]:
    """(seconds since round 0 started, val loss of theta_g) at the end of every outer round."""
    t0 = records[0]["time"] - records[0]["seconds_round"]
    return [(r["time"] - t0, r["val_loss"]) for r in records if (r["round"] + 1) % syncs == 0]


def summarize(records: list[list[dict]], syncs: int) -> dict:
    peers = [curve(recs, syncs) for recs in records]
    waits = [sum(r["seconds_comm_wait"] for r in recs) / sum(r["seconds_round"] for r in recs) for recs in records]
    steady = [r for recs in records for r in recs[1:-1]] or [r for recs in records for r in recs]
    return {
        "final_val_loss": statistics.mean(p[-1][1] for p in peers),
        "wall_s": statistics.mean(p[-1][0] for p in peers),
        "wait_share": statistics.mean(waits),
        "bytes_sent_per_sync": statistics.mean(r["bytes_sent"] for r in steady),
        "peak_bytes_per_s": max(r.get("bytes_per_s", 0.0) for recs in records for r in recs),
        "syncs": len(records[0]),
        "final_hashes_equal": len({tuple(recs[-1]["stage_hashes"]) for recs in records}) == 1,
        "curve_peer0": peers[0],
    }


def time_to(points: list[tuple[float, float]], loss: float) -> float | None:
    return next((t for t, v in points if v <= loss), None)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(results)
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.6), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for mode, r in results[rate]["modes"].items():
            xs, ys = zip(*r["curve_peer0"])
            ax.plot(xs, ys, marker=".", label=f"{mode} (lr {r['outer_lr']}, m {r['outer_momentum']})")
        ax.axhline(results[rate]["target_loss"], color="#444444", linestyle="--", linewidth=0.8)
        ax.set_xlabel("wall seconds since round 0 started")
        ax.set_ylabel("val loss of theta_g")
        ax.set_title(f"{rate} Mbit/s per peer", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rates", type=float, nargs="+", default=[100.0, 2.0], help="link rates in Mbit/s")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--quality", type=Path, default=RESULTS / "modes_quality.json",
                        help="convergence.py's result with each mode's best outer lr and momentum")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--keep", metavar="DIR", help="keep the peers' run dirs here (default: a temp dir)")
    parser.add_argument("--name", default="modes", help="result file name under benchmarks/results/")
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, _exit_cleanly)  # the network lab is torn down on the way out
    quality = json.loads(args.quality.read_text()) if args.quality.exists() else {}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(args.keep or tmp).resolve()
        for rate in args.rates:
            modes = {}
            for mode in args.modes:
                lr, momentum, source = tuned(quality, mode)
                started = time.perf_counter()
                records = run_mode(args, mode, rate, lr, momentum, tmp)
                flags = MODES[mode][0]
                syncs = int(flags[flags.index("--fragments") + 1]) if "--fragments" in flags else 1
                modes[mode] = {"outer_lr": lr, "outer_momentum": momentum, "lr_from": source,
                               "seconds_with_startup": time.perf_counter() - started, **summarize(records, syncs)}  # fmt: skip
                m = modes[mode]
                print(f"{rate:g} Mbit/s {mode:18s} final {m['final_val_loss']:.4f}  wall {m['wall_s']:6.1f} s  "
                      f"waiting {100 * m['wait_share']:4.1f}%  {m['bytes_sent_per_sync'] / 1e6:.2f} MB/sync  "
                      f"peak {m['peak_bytes_per_s'] / 1e6:.2f} MB/s", flush=True)
            target = max(m["final_val_loss"] for m in modes.values())
            for m in modes.values():
                m["seconds_to_target"] = time_to(m["curve_peer0"], target)
            results[f"{rate:g}"] = {"target_loss": target, "modes": modes, **_verdicts(modes)}
    title = (f"{args.peers} peers x {args.stages} stage(s), {args.preset}, {args.rounds} rounds x H={args.inner_steps}, "
             f"batch {args.batch_size}: equal tokens per mode; dashed: the loss every mode reaches")
    png = RESULTS / f"{args.name}.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, png, title)
    path = write_result(args.name, {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "link": "tc tbf at each rate, each way per peer, no added latency",
        "tau": TAU,
        "results": results,
        "plot": png.name,
    })  # fmt: skip
    for rate, r in results.items():
        print(f"{rate} Mbit/s: {json.dumps({k: v for k, v in r.items() if k != 'modes'})}")
    print(f"wrote {path} and {png}")
    return 0


def _verdicts(modes: dict) -> dict:
    """The targets of issue 18 for one link: the best overlapped mode within 1% of sync at equal tokens and
    ahead of it on time to the target loss; waits at most 5% of the run."""
    if "sync" not in modes:
        return {}
    sync = modes["sync"]
    overlapped = {n: m for n, m in modes.items() if not n.startswith("sync")}
    if not overlapped:
        return {}
    best = min(overlapped, key=lambda n: overlapped[n]["final_val_loss"])
    fastest = min(overlapped, key=lambda n: overlapped[n]["seconds_to_target"] or float("inf"))
    return {
        "best_overlapped_at_equal_tokens": best,
        "its_loss_vs_sync": overlapped[best]["final_val_loss"] / sync["final_val_loss"] - 1,
        "fastest_to_target": fastest,
        "its_time_vs_sync": (overlapped[fastest]["seconds_to_target"] or float("nan")) / (sync["seconds_to_target"] or float("nan")),
        "within_1_percent_of_sync": overlapped[best]["final_val_loss"] <= 1.01 * sync["final_val_loss"],
        "waits_at_most_5_percent": {n: m["wait_share"] <= 0.05 for n, m in overlapped.items()},
    }


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
