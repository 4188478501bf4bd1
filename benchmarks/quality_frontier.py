"""One frontier from several runs of the quality lab (benchmarks/convergence.py) of the same shape.

Each lab invocation writes its own frontier, of the configurations it ran; the issue's question (which
strategy gives the fewest bytes within 2% of sync fp32?) wants them side by side. The lab is deterministic,
so runs of one shape made on other days compare: this script refuses results whose shape, GPU setting or
target differ, or whose sync fp32 curves are not the same to the bit, and draws every configuration's best
run of them in one frontier (bytes against the final gap, and the gap round by round):

    python benchmarks/quality_frontier.py --name quality_frontier_tiny_300 \\
        benchmarks/results/quality_tiny_300.json benchmarks/results/quality_sync_int8_300.json ...

Writes results/NAME.json (the points, their sources and the command), NAME.png and NAME.md (the table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import RESULTS, write_result  # noqa: E402
from benchmarks.convergence import stored_shape  # noqa: E402
from benchmarks.quality_report import QUALITY_BAR, frontier_plot  # noqa: E402

BASELINE = "sync fp32"


def merged(paths: list[Path]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the shared shape and setting, label -> summary entry with its source), or SystemExit saying what differs."""
    payloads = {path: json.loads(path.read_text()) for path in paths}
    first_path, first = next(iter(payloads.items()))
    common = {"shape": stored_shape(first), "gpu_setting": first["gpu_setting"], "target_gap": first["target_gap"]}
    baseline = first["results"].get(BASELINE, {}).get("best", {}).get("val_curve")
    if baseline is None:
        raise SystemExit(f"{first_path}: holds no {BASELINE} run to measure the gaps against")
    points: dict[str, dict[str, Any]] = {}
    for path, payload in payloads.items():
        mine = {"shape": stored_shape(payload), "gpu_setting": payload["gpu_setting"], "target_gap": payload["target_gap"]}
        differ = [k for k in common if mine[k] != common[k]]
        if differ:
            raise SystemExit(f"{path}: differs from {first_path} in {', '.join(differ)}; runs of other shapes or "
                             "settings do not compare")  # fmt: skip
        theirs = payload["results"].get(BASELINE, {}).get("best", {}).get("val_curve")
        if theirs != baseline:
            raise SystemExit(f"{path}: its {BASELINE} curve is not {first_path}'s to the bit; its gaps were taken to "
                             "another baseline")  # fmt: skip
        for label, entry in payload["summary"].items():
            best = payload["results"][label]["best"]
            name = label if label == BASELINE else f"{label} (lr {best['outer_lr']:g}, m {best['outer_momentum']:g})"
            point = {**entry, "source": path.name}
            if name in points and points[name]["final_val"] != point["final_val"]:
                raise SystemExit(f"{path}: {name} ends at {point['final_val']}, in {points[name]['source']} at "
                                 f"{points[name]['final_val']}: the lab should repeat a run to the bit")  # fmt: skip
            points.setdefault(name, point)
    return common, points


def table(points: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per configuration, fewest bytes first."""
    rows = ["| configuration | x fewer bytes than an fp32 ring | final val | final gap | mean gap | worst, last half | "
            "to target on the GPU setting | meets the bar | from |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, p in sorted(points.items(), key=lambda kv: -kv[1]["ratio_vs_fp32_ring"]):
        reach = "not reached" if p["time_to_target_s"] is None else f"{p['time_to_target_s'] / 3600:.1f} h"
        rows.append(f"| {name} | {p['ratio_vs_fp32_ring']:.1f}x | {p['final_val']:.4f} | {100 * p['vs_sync_fp32']:+.1f}% | "
                    f"{100 * p['gap_mean']:+.1f}% | {100 * p['gap_last_half_max']:+.1f}% | {reach} | "
                    f"{'yes' if p['meets_bar'] else 'no'} | `{p['source']}` |")  # fmt: skip
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="results of benchmarks/convergence.py of one shape")
    parser.add_argument("--name", required=True, help="results/NAME.json, .png and .md")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    for path in args.results:
        if not path.is_file():
            parser.error(f"{path}: no such result file (benchmarks/results/*.json of benchmarks/convergence.py)")
    common, points = merged(args.results)
    s = common["shape"]
    png, md = args.out / f"{args.name}.png", args.out / f"{args.name}.md"
    args.out.mkdir(parents=True, exist_ok=True)
    frontier_plot(points, png, title=f"{s['preset']}, {s['peers']} peers, {s['rounds']} rounds x H={s['inner_steps']}, "
                                     f"{len(args.results)} runs of the quality lab")  # fmt: skip
    text = table(points)
    md.write_text(text)
    payload = {**common, "sources": [str(p) for p in args.results], "bar": QUALITY_BAR, "points": points,
               "plot": png.name, "table": md.name}  # fmt: skip
    path = write_result(args.name, payload, directory=args.out)
    print(text, end="")
    print(f"wrote {path}, {png} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
