"""What the quality lab (benchmarks/convergence.py) reports per configuration, beside its curve.

- The loss gap to `sync fp32` at equal tokens over the whole curve (round by round: both curves are per outer
  round of H inner steps, so a round holds the same tokens in every configuration): its mean, its worst over the
  last half, and at the end.
- Time to a target loss on a GPU setting of the netns benchmark's link model (benchmarks/netns/gpu.py: a `1b`
  peer on one H100 at 100 Mbit/s by default). A round there lasts its compute plus what of its exchange the mode
  cannot hide: the exchange moves the configuration's bytes (its measured ratio to an fp32 ring) at the link's
  rate; `sync` waits for all of it, the one-round-behind modes (delayed, eager, own) hide up to a round of it,
  `streaming` hides each fragment's behind the same share of a sync round as the run's tau of its H. The target
  is `sync fp32`'s final loss plus --target-gap (2%): how long each configuration takes to get within that.
  The exchange's fixed cost (under a second in the lab, docs/benchmarks.md) is left out: a `1b` round is minutes.
- The frontier: bytes against loss gap, one point per configuration at its best outer lr and momentum (PNG).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.netns.gpu import GpuSetting

__all__ = ["QUALITY_BAR", "curve_gaps", "frontier_plot", "round_wall_seconds", "summarize", "time_to_target"]

QUALITY_BAR = {"min_ratio": 100.0, "final_gap": 0.02, "last_half_gap": 0.05}
"""Issue 40: >= 100x fewer bytes than an fp32 ring, within 2% of sync fp32 at the end and 5% over the last half."""


def curve_gaps(curve: Sequence[float], baseline: Sequence[float]) -> dict[str, float]:
    """The relative gap of `curve` to `baseline` round by round (equal tokens), over the rounds both hold."""
    n = min(len(curve), len(baseline))
    if n == 0:
        raise ValueError("no round in common: the curves are empty")
    gaps = [curve[i] / baseline[i] - 1 for i in range(n)]
    last_half = gaps[n // 2 :]
    return {"mean": sum(gaps) / n, "last_half_max": max(last_half), "final": gaps[-1], "per_round": gaps}


def round_wall_seconds(setting: GpuSetting, *, ratio_vs_fp32_ring: float, mode: str, fragments: int = 1,
                       overlap_share: float = 0.0) -> float:  # fmt: skip
    """Seconds one outer round lasts on `setting` for a configuration whose exchange moves 1/`ratio_vs_fp32_ring`
    of an fp32 ring's bytes: its compute plus what of its exchange `mode` leaves exposed (`overlap_share`:
    streaming's tau as a share of a sync round)."""
    exchange = setting.fp32_ring_seconds / ratio_vs_fp32_ring
    compute = setting.round_seconds
    if mode == "sync":
        return compute + exchange
    if mode in ("delayed", "eager", "own"):
        return compute + max(0.0, exchange - compute)
    if mode == "streaming":
        hidden = overlap_share * compute / fragments  # tau of each sync round of H / P steps
        return compute + fragments * max(0.0, exchange / fragments - hidden)
    raise ValueError(f"unknown outer mode {mode!r}")


def time_to_target(curve: Sequence[float], target: float, *, wall_per_round: float) -> float | None:
    """Seconds until the curve first reaches `target` (None: it never does)."""
    for i, loss in enumerate(curve):
        if loss <= target:
            return (i + 1) * wall_per_round
    return None


def summarize(results: Mapping[str, Mapping[str, Any]], outer: Mapping[str, Mapping[str, Any]], *,
              setting: GpuSetting, target_gap: float, baseline: str = "sync fp32") -> dict[str, dict[str, Any]]:  # fmt: skip
    """Per configuration (its best run): bytes ratio, gaps to `baseline` over the curve, time to `baseline`'s final
    loss plus `target_gap` on `setting`, and whether it meets QUALITY_BAR. `outer`: per configuration its "mode",
    "fragments" and "overlap_share"."""
    base = results.get(baseline, {}).get("best")
    target = base["final_val"] * (1 + target_gap) if base else None
    out = {}
    for label, r in results.items():
        best = r["best"]
        wall = round_wall_seconds(setting, ratio_vs_fp32_ring=best["ratio_vs_fp32_ring"], **outer[label])
        gaps = curve_gaps(best["val_curve"], base["val_curve"]) if base else None
        seconds = time_to_target(best["val_curve"], target, wall_per_round=wall) if target is not None else None
        out[label] = {
            "ratio_vs_fp32_ring": best["ratio_vs_fp32_ring"],
            "final_val": best["final_val"],
            "vs_sync_fp32": gaps["final"] if gaps else None,  # the final gap (the name project_inputs.py reads)
            "gap_mean": gaps["mean"] if gaps else None,
            "gap_last_half_max": gaps["last_half_max"] if gaps else None,
            "gap_per_round": gaps["per_round"] if gaps else None,
            "round_wall_s": wall,
            "time_to_target_s": seconds,
            "meets_bar": bool(gaps and best["ratio_vs_fp32_ring"] >= QUALITY_BAR["min_ratio"]
                              and gaps["final"] <= QUALITY_BAR["final_gap"]
                              and gaps["last_half_max"] <= QUALITY_BAR["last_half_gap"]),
        }  # fmt: skip
    return out


def frontier_plot(summary: Mapping[str, Mapping[str, Any]], path: Path, *, title: str) -> None:
    """Left: bytes (x fewer than an fp32 ring, log) against the final gap to sync fp32, one point per configuration;
    right: each configuration's gap round by round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for label, s in summary.items():
        if s["vs_sync_fp32"] is None:
            continue
        left.scatter(s["ratio_vs_fp32_ring"], 100 * s["vs_sync_fp32"])
        left.annotate(label, (s["ratio_vs_fp32_ring"], 100 * s["vs_sync_fp32"]), fontsize=7, xytext=(3, 3),
                      textcoords="offset points")  # fmt: skip
        right.plot([100 * g for g in s["gap_per_round"]], label=label)
    left.set_xscale("log")
    left.axhline(100 * QUALITY_BAR["final_gap"], color="grey", linestyle="--", linewidth=0.8)
    left.axvline(QUALITY_BAR["min_ratio"], color="grey", linestyle="--", linewidth=0.8)
    left.set_xlabel("x fewer bytes per round than an fp32 ring")
    left.set_ylabel("final val loss vs sync fp32 (%)")
    right.axhline(100 * QUALITY_BAR["final_gap"], color="grey", linestyle="--", linewidth=0.8)
    right.set_xlabel("round (equal tokens)")
    right.set_ylabel("val loss vs sync fp32 (%)")
    right.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
