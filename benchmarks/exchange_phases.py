#!/usr/bin/env python3
"""Where the exchanges of finished runs spent their time, phase by phase (metrics.jsonl: exchange_phases).

    python benchmarks/exchange_phases.py RUN_DIR [RUN_DIR ...]      # peers' run directories, or any folder above them
    pytest -m swarm tests/swarm --basetemp=/tmp/sw && python benchmarks/exchange_phases.py /tmp/sw --name phases_swarm

Reads every `metrics.jsonl` below the given folders (pytest's `*current` links are skipped, so that a
run is counted once) and, per phase (swarm/phase_clock.py: wait, encode, matchmaking, transfer, phase2,
decode, mend, borrow, agree, other), gives the number of exchanges, the median, the 90th percentile,
the largest and the total seconds, and the slowest exchanges with their run, round, stage and kind.
Writes benchmarks/results/NAME.json (default `exchange_phases`). The fixed cost of an exchange is what
a lean exchange has to cut (issue 37): the phases say which part of it to cut first.
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
                for stage, phases in enumerate(record.get("exchange_phases") or []):
                    if phases:
                        kind = (record.get("kinds") or [None] * (stage + 1))[stage]
                        out.append({"run": str(path.parent), "round": record["round"], "stage": stage, "kind": kind,
                                    "phases": phases})  # fmt: skip
    return out


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
    print(f"[phases] {report['exchanges']} exchanges; results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
