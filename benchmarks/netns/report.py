"""From the peers' records and counters to the numbers, the targets, the plot and the markdown table.

Steady state, as benchmarks/overlap.py takes it: from the end of round 0 (start-up) to the end of the
round before the last (the last one drains what is in flight). Over that window, per peer: tokens/s,
and the bytes its eth0 moved (rx + tx, interface counters: payload, headers, DHT traffic, all of it)
per round of H inner steps. An fp32 ring all-reduce of the same parameters moves 2 (N-1)/N x 4 bytes x
params each way per member: `ratio_to_fp32_ring` is the wire bytes over twice that.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.modes import curve
from benchmarks.netns.runner import PeerRun

__all__ = ["markdown", "plot", "summarize", "targets"]


def summarize(run: PeerRun, *, tokens_per_round: int, ring_sent: float, syncs: int = 1, shared: bool = True) -> dict:
    """Throughput, wire bytes, loss, waiting and agreement of one run (see the module docstring); `shared`:
    the peers train one model (False: alone, where equal hashes mean nothing)."""
    if any(len(recs) < 3 for recs in run.records):
        raise SystemExit(f"too few records for a steady state: {[len(r) for r in run.records]} (need 3 per peer)")
    rates, wire, tx, payload, other = [], [], [], [], []
    for host, recs in enumerate(run.records):
        a, b = recs[0], recs[-2]
        tokens, seconds = b["tokens"] - a["tokens"], b["time"] - a["time"]
        rates.append(tokens / seconds)
        rx_bytes, tx_bytes = run.wire(host, a["time"], b["time"])
        wire.append((rx_bytes + tx_bytes) * tokens_per_round / tokens)
        tx.append(tx_bytes * tokens_per_round / tokens)
        sent = [r["bytes_sent"] for r in recs[1:-1]]
        if all(s is not None for s in sent):
            payload.append(sum(sent) * tokens_per_round / tokens)
            moved = sum(r["bytes_sent"] + r["bytes_received"] for r in recs[1:-1])
            other.append((rx_bytes + tx_bytes - moved) / seconds)  # DHT, matchmaking, headers, acks
    finals = [recs[-1]["val_loss"] for recs in run.records if recs[-1]["val_loss"] is not None]
    has_curve = all(r["val_loss"] is not None for r in run.records[0])
    return {
        "tokens_per_s": statistics.mean(rates),
        "tokens_per_s_per_peer": rates,
        "wire_bytes_per_peer_per_round": statistics.mean(wire),
        "wire_tx_bytes_per_peer_per_round": statistics.mean(tx),
        "ratio_to_fp32_ring": statistics.mean(wire) / (2 * ring_sent),
        "payload_sent_per_peer_per_round": statistics.mean(payload) if payload else None,
        "payload_ratio_to_fp32_ring": statistics.mean(payload) / ring_sent if payload else None,
        "other_wire_bytes_per_s": statistics.mean(other) if other else None,
        "final_val_loss": statistics.mean(finals) if finals else None,
        "wall_s": statistics.mean(recs[-1]["time"] - recs[0]["time"] + recs[0]["seconds_round"] for recs in run.records),
        "wait_share": statistics.mean(
            sum(r["seconds_comm_wait"] for r in recs) / sum(r["seconds_round"] for r in recs) for recs in run.records
        ),
        "hashes_equal": len({tuple(recs[-1]["stage_hashes"]) for recs in run.records}) == 1 if shared else None,
        "group_sizes": sorted({r.get("group_size") or 0 for recs in run.records for r in recs} - {0}),
        "records": len(run.records[0]),
        "seconds_with_startup": run.seconds,
        "curve_peer0": curve(run.records[0], syncs) if has_curve else None,
    }


def targets(results: dict[str, dict], allreduce: list[dict], *, first: str, ours: list[str]) -> list[dict]:
    """Every target of the issue with its measured value; `first` is the 100 Mbit/s-like setting."""
    rows = []

    def add(target: str, setting: str, variant: str, measured: float | None, threshold: float, below: bool) -> None:
        met = measured is not None and (measured <= threshold if below else measured >= threshold)
        rows.append({"target": target, "setting": setting, "variant": variant, "measured": measured,
                     "threshold": threshold, "met": met})  # fmt: skip

    at = results[first]
    for v in ours:
        add("wire bytes per round <= 1/100 of an fp32 ring all-reduce", first, v, at[v]["ratio_to_fp32_ring"], 0.01, True)
    for v in ours:
        add("payload bytes sent per round <= 1/100 of an fp32 ring all-reduce (our count, no DHT traffic)", first, v,
            at[v]["payload_ratio_to_fp32_ring"], 0.01, True)  # fmt: skip
    if "default" in at:
        add("utilization of the default mode >= 0.95", first, "default", at["default"]["utilization"], 0.95, False)
    for setting, res in results.items():
        for v in ours:
            if "ddp-gloo" in res and v in res:
                add("speedup over ddp-gloo >= 0.9 x the ideal (no-comm / ddp)", setting, v, res[v]["speedup_vs_ideal"],
                    0.9, False)  # fmt: skip
    sync = at.get("sync-fp32", {}).get("final_val_loss")
    for v in ours:
        if v != "sync-fp32" and sync is not None and at[v]["final_val_loss"] is not None:
            add("val loss at equal tokens <= ours sync fp32 (ratio)", first, v, at[v]["final_val_loss"] / sync, 1.0, True)
    for row in allreduce:
        add("all-reduce <= 1.1 x the ideal ring time for its payload", "allreduce", row["strategy"], row["vs_ideal"],
            1.1, True)  # fmt: skip
    return rows


def plot(results: dict[str, dict], ring_sent: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(results)
    variants = list(dict.fromkeys(v for res in results.values() for v in res))
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.2))
    width = 0.8 / len(settings)
    for i, setting in enumerate(settings):
        xs = [k + i * width for k in range(len(variants))]
        res = results[setting]
        axes[0].bar(xs, [res[v]["utilization"] if v in res else 0 for v in variants], width, label=setting)
        axes[1].bar(xs, [res[v]["wire_bytes_per_peer_per_round"] / 1e6 if v in res else 0 for v in variants], width,
                    label=setting)  # fmt: skip
    labels = ((axes[0], "tokens/s vs no communication"),
              (axes[1], "MB per peer per round on the wire (rx+tx)"))
    for ax, label in labels:
        ax.set_xticks([k + width * (len(settings) - 1) / 2 for k in range(len(variants))], variants, rotation=35,
                      ha="right", fontsize=8)  # fmt: skip
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    axes[0].axhline(0.95, color="#444444", linestyle="--", linewidth=0.8)
    axes[1].set_yscale("log")
    axes[1].set_title("dashed: an fp32 ring all-reduce (rx+tx); dotted: 1/100 of it", fontsize=8)
    axes[1].axhline(2 * ring_sent / 1e6, color="#444444", linestyle="--", linewidth=0.8)
    axes[1].axhline(2 * ring_sent / 1e8, color="#999999", linestyle=":", linewidth=0.8)
    for i, setting in enumerate(settings):  # what ours counts as payload (sent + received), beside the wire's bars
        res = results[setting]
        points = [(k + i * width, 2 * res[v]["payload_sent_per_peer_per_round"] / 1e6) for k, v in enumerate(variants)
                  if v in res and res[v].get("payload_sent_per_peer_per_round")]  # fmt: skip
        if points:
            axes[1].scatter(*zip(*points, strict=True), marker="_", s=120, color="black", zorder=3,
                            label="payload (ours' count, x2)" if i == 0 else None)  # fmt: skip
    axes[1].legend(fontsize=7)
    _curves(axes[2], results[settings[0]])
    axes[2].set_title(settings[0], fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _curves(ax, res: dict) -> None:
    for v, r in res.items():
        if r.get("curve_peer0"):
            xs, ys = zip(*r["curve_peer0"], strict=True)
            ax.plot(xs, ys, marker=".", label=v, linestyle="--" if r.get("curve_projected") else "-")
    ax.set_xlabel("wall seconds since round 0 started (dashed: projected from throughput)")
    ax.set_ylabel("val loss (theta_g; ddp: the model)")
    ax.legend(fontsize=7)


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def _wall(r: dict) -> str:
    """Wall seconds of the run; a bounded DDP run's projected to all rounds from its throughput (marked *)."""
    return f"{r['wall_projected_s']:.1f}*" if r.get("wall_projected_s") else f"{r['wall_s']:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def markdown(payload: dict) -> str:
    """The results as markdown tables (the README quotes them)."""
    lines = ["# benchmarks.netns", "", f"Command: `{payload['command_line']}`", ""]
    lines += ["| setting | GPU ratio (fp32 ring / round) | lab link | rounds |", "| --- | --- | --- | --- |"]
    for s in payload["settings"]["gpu"]:
        lab = payload["settings"]["lab_rates_mbit"][s["name"]]
        lines.append(f"| {s['name']} | {s['ratio']:.3f} | {lab:.2f} Mbit/s | {payload['settings']['rounds'][s['name']]} |")
    for setting, res in payload["results"].items():
        lines += ["", f"## {setting}", "",
                  "| variant | mode / compression | outer lr / m | tokens/s | utilization | MB/round (wire) | "
                  "vs fp32 ring (wire) | vs fp32 ring (payload) | final val | wall s | waiting | equal hashes |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for v, r in res.items():
            lr = "-" if r["outer_lr"] is None else f"{r['outer_lr']:g} / {r['outer_momentum']:g}"
            lines.append(
                f"| {v} | {r['mode']} / {r['compression']} | {lr} | {r['tokens_per_s']:,.0f} | {r['utilization']:.3f} | "
                f"{_mb(r['wire_bytes_per_peer_per_round'])} | {r['ratio_to_fp32_ring']:.4f} | "
                f"{_num(r['payload_ratio_to_fp32_ring'], '.4f')} | "
                f"{_num(r['final_val_loss'], '.4f')} | {_wall(r)} | {100 * r['wait_share']:.1f}% | "
                f"{'-' if r['hashes_equal'] is None else r['hashes_equal']} |"
            )
    lines += ["", "## All-reduce alone", "",
              "| strategy | payload MB | sent MB per peer | seconds | ideal ring s | x ideal | x its algorithm's ideal |",
              "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in payload["allreduce"]:
        lines.append(f"| {row['strategy']} | {_mb(row['payload_bytes'])} | {_mb(row['bytes_sent_per_peer'])} | "
                     f"{row['seconds']:.3f} | {row['ideal_ring_seconds']:.3f} | {row['vs_ideal']:.2f} | "
                     f"{row['vs_algorithm_ideal']:.2f} |")  # fmt: skip
    lines += ["", "## Targets", "", "| target | setting | variant | measured | threshold | met |",
              "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for t in payload["targets"]:
        lines.append(f"| {t['target']} | {t['setting']} | {t['variant']} | {_num(t['measured'], '.4g')} | "
                     f"{t['threshold']:g} | {'yes' if t['met'] else '**no**'} |")  # fmt: skip
    lines += ["", "## Shortcuts and notes", "", "- wall s marked *: projected from the run's throughput"]
    lines += [f"- {n}" for n in payload["notes"]]
    return "\n".join(lines) + "\n"
