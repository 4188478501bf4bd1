"""`dilocox-peer plot RUN_DIR...`: a PNG of loss and throughput per round (one line per run dir)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import DilocoxError
from ..metrics import read_metrics

__all__ = ["plot_runs"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="plot loss and throughput of one or more run dirs", description=__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", metavar="PNG", help="output file (default RUN_DIR/plot.png of the first run dir)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    out = plot_runs([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None)
    print(out)
    return 0


def plot_runs(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write the plot and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for run_dir in run_dirs:
        records = read_metrics(run_dir / "metrics.jsonl")
        if not records:
            raise DilocoxError(f"{run_dir}/metrics.jsonl holds no rounds yet; nothing to plot")
        info_path = run_dir / "run.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        runs.append((run_dir, records, info))

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run_dir, records, info in runs:
        label = run_dir.name
        tokens = [r["tokens"] / 1e6 for r in records]
        train = [r["train_loss"] if r["train_loss"] is not None else float("nan") for r in records]  # none after a jump
        line = ax_loss.plot(tokens, train, alpha=0.5, label=f"{label} train")[0]
        val_x, val_y = tokens, [r["val_loss"] for r in records]
        if "initial_val_loss" in info:
            first = records[0]["round"]
            if first == 0:
                val_x, val_y = [0.0, *val_x], [info["initial_val_loss"], *val_y]
        ax_loss.plot(val_x, val_y, color=line.get_color(), marker=".", label=f"{label} val (theta_g)")
        ax_tps.plot([r["round"] + 1 for r in records], [r["tokens_per_s"] for r in records], label=label)
    ax_loss.set(xlabel="tokens trained by the peer (M)", ylabel="loss (nats/byte)", title="loss")
    ax_tps.set(xlabel="round", ylabel="tokens/s (round wall time)", title="throughput")
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = out or run_dirs[0] / "plot.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
