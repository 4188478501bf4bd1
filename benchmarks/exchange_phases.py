#!/usr/bin/env python3
"""Where the exchanges of finished runs spent their time, phase by phase (metrics.jsonl: exchange_phases).

    python benchmarks/exchange_phases.py RUN_DIR [RUN_DIR ...]      # peers' run directories, or any folder above them
    pytest -m swarm tests/swarm --basetemp=/tmp/sw && python benchmarks/exchange_phases.py /tmp/sw --name phases_swarm

Reads every `metrics.jsonl` below the given folders (pytest's `*current` links are skipped, so that a
run is counted once) and, per phase (swarm/phase_clock.py: wait, encode, matchmaking, transfer, phase2,
decode, mend, borrow, agree, other), gives the number of exchanges, the median, the 90th percentile,
the largest and the total seconds, and the slowest exchanges with their run, round, stage and kind.
Writes benchmarks/results/NAME.json (default `exchange_phases`). The fixed cost of an exchange is what
a lean exchange has to cut (issue 37): the phases say which part of it to cut first. With `allreduce_windows`
it also says how fast each round's group came together (`groups`): from the last member's start of the round
to the last one entering the group search, to the group formed, and to the last exchange's end (phase 5 left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, write_result  # noqa: E402


def exchanges(folders: list[Path]) -> list[dict[str, Any]]:
    """One entry per stage exchange applied in the runs below `folders`: its run, round, stage, kind, phases."""
    out = []
    for folder in folders:
        for path in sorted(folder.rglob("metrics.jsonl")):
            if any(part.endswith("current") for part in path.parts):
                continue  # pytest's link to the newest run: the same files again
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed peer
                windows = record.get("allreduce_windows") or []
                for stage, phases in enumerate(record.get("exchange_phases") or []):
                    if phases:
                        kind = (record.get("kinds") or [None] * (stage + 1))[stage]
                        window = windows[stage] if stage < len(windows) else None
                        out.append({"run": str(path.parent), "round": record["round"], "stage": stage, "kind": kind,
                                    "phases": phases, "window": window})  # fmt: skip
    return out


def groups(found: list[dict[str, Any]]) -> dict[str, Any]:
    """How fast each round's group came together, from its members' clocks (one machine: one clock). Per run
    folder's parent (the swarm), round and stage, over groups whose members all averaged (rounds from 1): from
    the moment the last member started the round to its entering the group search (`entered`: phase 1's lag in
    seeing it), to the group formed on every member (`formed`), and to the last member's exchange end before
    phase 5 (`ended`). Medians and 90th percentiles, seconds."""
    by_group: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for e in found:
        if e["window"] and e["kind"] == "averaged" and e["round"] >= 1:
            by_group.setdefault((str(Path(e["run"]).parent), e["round"], e["stage"]), []).append(e)
    lags: dict[str, list[float]] = {"entered": [], "formed": [], "ended": []}
    for members in by_group.values():
        if len(members) < 2:
            continue
        start = max(m["window"][0] - m["phases"].get("wait", 0.0) for m in members)
        entered = max(m["window"][0] for m in members)
        formed = max(m["window"][0] + m["phases"].get("matchmaking", 0.0) for m in members)
        ended = max(m["window"][0] + sum(v for k, v in m["phases"].items() if k not in ("wait", "agree")) for m in members)
        for name, t in (("entered", entered), ("formed", formed), ("ended", ended)):
            lags[name].append(t - start)
    return {
        "groups": len(lags["entered"]),
        **{f"last_start_to_{k}": _spread(v) for k, v in lags.items() if v},
    }


def _spread(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    return {"median": round(statistics.median(values), 3), "p90": round(values[int(0.9 * (len(values) - 1))], 3)}


def summarize(found: list[dict[str, Any]], slowest: int = 20) -> dict[str, Any]:
    by_phase: dict[str, list[float]] = {}
    for exchange in found:
        for phase, seconds in exchange["phases"].items():
            by_phase.setdefault(phase, []).append(seconds)
    phases = {}
    for phase, values in by_phase.items():
        values.sort()
        phases[phase] = {
            "n": len(values), "median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))],
            "max": values[-1], "total": round(sum(values), 3),
        }  # fmt: skip
    ranked = sorted(((s, p, e) for e in found for p, s in e["phases"].items()), key=lambda t: -t[0])[:slowest]
    return {
        "exchanges": len(found),
        "phases": phases,
        "groups": groups(found),
        "slowest": [{"seconds": s, "phase": p, **{k: e[k] for k in ("run", "round", "stage", "kind")}} for s, p, e in ranked],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--name", default="exchange_phases", help="results: OUT/NAME.json")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    found = exchanges(args.folders)
    if not found:
        print(f"no exchange_phases in any metrics.jsonl below {', '.join(map(str, args.folders))}", file=sys.stderr)
        return 1
    report = summarize(found)
    path = write_result(args.name, report, directory=args.out)
    for phase, s in sorted(report["phases"].items(), key=lambda kv: -kv[1]["total"]):
        print(f"[phases] {phase:12s} n={s['n']:5d} median {s['median']:.3f} s  p90 {s['p90']:.3f} s  "
              f"max {s['max']:.2f} s  total {s['total']:.1f} s")  # fmt: skip
    g = report["groups"]
    for name in ("entered", "formed", "ended"):
        if f"last_start_to_{name}" in g:
            s = g[f"last_start_to_{name}"]
            print(f"[groups] last member's start to the last {name:8s} median {s['median']:.3f} s  p90 {s['p90']:.3f} s")
    print(f"[phases] {report['exchanges']} exchanges, {g['groups']} whole groups; results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
