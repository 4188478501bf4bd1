"""The measured inputs of benchmarks/project.py, read from benchmarks/results/*.json, each with its source.

A Figure is one input with the file and field it came from (or a flagged default where nothing was measured);
Measured holds them all: the share of throughput kept while exchanging (overlap.json, else netns.json), our
exchange's seconds against an ideal one (netns.json, else modes.json), the strategies' ratios and codec seconds
(compression.json) and this project's loss gaps at equal tokens. load_measured reads them; nothing is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS
from benchmarks.project_model import FP32, Strategy

__all__ = ["Figure", "Measured", "load_measured"]


# ----- measured inputs ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    value: float
    source: str
    measured: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    utilization: Figure
    allreduce_vs_ideal: Figure
    strategies: tuple[Strategy, ...]
    notes: tuple[str, ...] = ()
    quality: dict[str, Any] = field(default_factory=dict)


def _read(results: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((results / name).read_text())
    except (OSError, ValueError):
        return None


def _utilization(results: Path, notes: list[str]) -> Figure:
    """The share of throughput kept while an exchange runs in the background. overlap.json measures exactly that
    (delayed vs no averaging, interleaved repeats); netns.json's low-rank run also pays low-rank's codec on the
    lab's shared CPU, which the model adds on its own (compression.json), so it is the fallback."""
    overlap = _read(results, "overlap.json") or {}
    summary = overlap.get("ratio_summary", {})
    keys = [k for k in summary if k.startswith("delayed")]
    key = "delayed (helper_nice 0)" if "delayed (helper_nice 0)" in keys else (keys[0] if keys else None)
    mean = summary[key].get("mean") if key and isinstance(summary[key], dict) else None
    if isinstance(mean, (int, float)) and mean > 0:
        return Figure(value=min(mean, 1.0),
                      source=f"overlap.json: ratio_summary['{key}'].mean (tokens/s vs no averaging, "
                             f"{overlap.get('link', '?')})", measured=True)  # fmt: skip
    netns = _read(results, "netns.json")
    found = _netns_utilization(netns) if netns else None
    notes.append("overlap.json missing or without a delayed ratio: utilization from "
                 + ("netns.json (its codec seconds are counted twice)" if found else "nowhere"))  # fmt: skip
    if found:
        return Figure(value=min(found[0], 1.0), source=f"netns.json: {found[1]}", measured=True)
    notes.append("utilization 1.0 assumed (DEFAULT)")
    return Figure(value=1.0, source="default: nothing measured", measured=False)


def _allreduce_vs_ideal(results: Path, notes: list[str]) -> Figure:
    netns = _read(results, "netns.json")
    row = next((r for r in (netns or {}).get("allreduce", []) if r.get("strategy") == "none"), None)
    if row:
        return Figure(value=max(row["vs_ideal"], 1.0), measured=True,
                      source=f"netns.json: allreduce[strategy none].vs_ideal (the fp32 butterfly of "
                             f"{row['values']:,} values at {row['rate_mbit']:g} Mbit/s: {row['seconds']:.2f} s)")  # fmt: skip
    notes.append("netns.json " + ("has no fp32 all-reduce row" if netns else "missing") + ": all-reduce efficiency "
                 "derived from modes.json (sync fp32 on the slowest link; an upper bound: its wait includes "
                 "matchmaking and waiting for the slowest peer's training)")  # fmt: skip
    modes = (_read(results, "modes.json") or {}).get("results", {})
    try:
        rate, key = min((float(r), r) for r in modes if _is_float(r) and "sync" in modes[r].get("modes", {}))
        sync = modes[key]["modes"]["sync"]
        waited = sync["wall_s"] * sync["wait_share"] / sync["syncs"]
        ideal = sync["bytes_sent_per_sync"] / (rate * 1e6 / 8)
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        notes.append("modes.json missing or without a sync run: all-reduce efficiency 1.0 (ideal) assumed (DEFAULT)")
        return Figure(value=1.0, source="default: nothing measured", measured=False)
    return Figure(
        value=max(waited / ideal, 1.0), source=f"modes.json: results['{key}'].modes.sync: wall_s x wait_share / "
        f"syncs ({waited:.2f} s) over bytes_sent_per_sync at {rate:g} Mbit/s ({ideal:.2f} s)", measured=True,
    )  # fmt: skip


def _netns_utilization(netns: dict[str, Any]) -> tuple[float, str] | None:
    """The share of throughput kept while exchanges run in the background: ours' `lowrank` (delayed, the model's
    default mode) on the lab's fastest setting, where its exchange hides behind the round."""
    runs = [(name, res["lowrank"]) for name, res in netns.get("results", {}).items()
            if res.get("lowrank", {}).get("utilization")]  # fmt: skip
    if not runs:
        return None
    name, run = max(runs, key=lambda item: item[1].get("rate_mbit") or 0.0)
    return run["utilization"], f"results['{name}'].lowrank.utilization (delayed low-rank, tokens/s vs nocomm)"


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _strategies(results: Path, notes: list[str]) -> tuple[Strategy, ...]:
    data = _read(results, "compression.json")
    if not data or not data.get("strategies"):
        notes.append("compression.json missing: only fp32 (and any --assumed-ratio) projected (DEFAULT)")
        return (FP32,)
    group = data.get("group_size", 3)
    out = [FP32]
    for name, s in data["strategies"].items():
        try:
            params = s["params"]
            out.append(Strategy(
                name=name, message_ratio=s["ratio_vs_fp32_message"], all_gather=True,
                encode_s_per_param=s["encode_s"] / params,
                background_s_per_param_member=(s.get("phase2_s", 0.0) + s["decode_s"]) / params / group,
                source=f"compression.json: strategies['{name}'] (ratio_vs_fp32_message; encode_s; (phase2_s + "
                       f"decode_s) / group_size {group}; preset {data.get('preset')}, {params:,} params)",
            ))  # fmt: skip
        except (KeyError, TypeError, ZeroDivisionError):
            notes.append(f"compression.json: strategy {name!r} lacks a field the model reads: left out")
    return tuple(out)


def _quality(results: Path) -> dict[str, Any]:
    """This project's loss gaps at equal tokens (what the throughput leaves out)."""
    out: dict[str, Any] = {}
    for name in ("modes_quality.json", "convergence.json"):
        summary = (_read(results, name) or {}).get("summary", {})
        if summary:
            out[name] = {k: {"vs_sync_fp32": v.get("vs_sync_fp32"), "ratio_vs_fp32_ring": v.get("ratio_vs_fp32_ring")}
                         for k, v in summary.items()}  # fmt: skip
    return out


def load_measured(results: Path = RESULTS) -> Measured:
    """The measured inputs from results/*.json, each with its source; a missing file gives a flagged default."""
    notes: list[str] = []
    return Measured(
        utilization=_utilization(results, notes), allreduce_vs_ideal=_allreduce_vs_ideal(results, notes),
        strategies=_strategies(results, notes), notes=tuple(notes), quality=_quality(results),
    )  # fmt: skip
