#!/usr/bin/env python3
"""Inner-training throughput of one peer for 1, 2 and 4 pipeline stages, side by side.

    python benchmarks/inner_throughput.py                       # CPU, tiny model
    python benchmarks/inner_throughput.py --device cuda --preset 125m --stages 1 --name inner_throughput_cuda

Each configuration runs `dilocox-peer join --no-swarm` (real stage processes, real
pipeline over gloo/NCCL) for a few rounds; tokens/s is the median of the rounds after the
first (warm-up). Writes benchmarks/results/<name>.json.
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
from benchmarks.common import write_result  # noqa: E402


def run(stages: int, args: argparse.Namespace, tmp: Path) -> dict:
    run_dir = tmp / f"s{stages}"
    cmd = [
        sys.executable, "-m", "dilocox_p2p.cli", "join", "--no-swarm", "--run-dir", str(run_dir),
        "--preset", args.preset, "--stages", str(stages), "--device", args.device,
        "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps),
        "--batch-size", str(args.batch_size), "--microbatches", str(args.microbatches),
        "--progress", "off", "--log-level", "warning", "--data-seed", "0",
        *(f for kv in args.set for f in ("--set", kv)),
    ]
    subprocess.run(cmd, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    return {
        "stages": stages,
        "tokens_per_s": statistics.median(steady),
        "tokens_per_s_per_round": [r["tokens_per_s"] for r in records],
        "params": records[0]["params"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--name", default="inner_throughput")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override passed to join (e.g. run.checkpoint_every=100: a 1b checkpoint is 16 GB)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for stages in args.stages:
            result = run(stages, args, Path(tmp))
            print(f"{stages} stage(s): {result['tokens_per_s']:,.0f} tokens/s", flush=True)
            results.append(result)
    base = results[0]["tokens_per_s"]
    for r in results:
        r["ratio_to_first"] = r["tokens_per_s"] / base
    path = write_result(args.name, {"config": vars(args), "results": results})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
