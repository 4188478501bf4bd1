#!/usr/bin/env python3
"""What the p2p daemon's garbage collector costs: CPU and peak memory of two hivemind p2p daemons relaying calls,
at Go's default (GOGC=100) and at the settings join gives them (swarm/daemon_gc.py), side by side in one run.

    python benchmarks/daemon_gc.py                      # 100 calls of 500 kB, 3 alternating repeats
    python benchmarks/daemon_gc.py --bytes 2000 --calls 1000 --name daemon_gc_small_calls

Each repeat runs every setting once, in turn (a setting's daemons are started fresh, in a child interpreter whose
environment carries it): daemon B calls a handler served by daemon A `--calls` times with an AveragingData message
of `--bytes` random bytes, after one warm-up call. Reported per run: the CPU seconds each daemon spent on the calls
(from /proc, user + system), its peak resident set (VmHWM) and the calls' wall time. Writes
benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, write_result  # noqa: E402
from dilocox_p2p.swarm.daemon_gc import DAEMON_GOGC, DAEMON_GOMEMLIMIT  # noqa: E402

SETTINGS = {
    "go_default": {"GOGC": "100"},
    "join": {"GOGC": DAEMON_GOGC, "GOMEMLIMIT": DAEMON_GOMEMLIMIT},
}

_CHILD = """
import asyncio, json, os, sys, time
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2

def cpu(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

def daemons():  # this process's p2p daemons (hivemind starts them as its children), the first started first
    children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    return sorted(int(c) for c in children if open(f"/proc/{c}/comm").read().strip() == "p2pd")

def peak_mb(pid):
    line = next(x for x in open(f"/proc/{pid}/status") if x.startswith("VmHWM"))
    return int(line.split()[1]) / 1024

async def main(size, calls):
    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await a.get_visible_maddrs())
    try:
        async def handler(request, context):
            return averaging_pb2.AveragingData(code=1)
        await a.add_protobuf_handler("bench", handler, averaging_pb2.AveragingData)
        message = averaging_pb2.AveragingData(code=1)
        message.tensor_part.buffer = os.urandom(size)
        await b.call_protobuf_handler(a.peer_id, "bench", message, averaging_pb2.AveragingData)
        pids = daemons()
        assert len(pids) == 2, pids
        before, start = [cpu(p) for p in pids], time.perf_counter()
        for _ in range(calls):
            await b.call_protobuf_handler(a.peer_id, "bench", message, averaging_pb2.AveragingData)
        wall = time.perf_counter() - start
        print(json.dumps({"daemon_cpu_s": [round(cpu(p) - t, 3) for p, t in zip(pids, before)],
                          "daemon_peak_mb": [round(peak_mb(p), 1) for p in pids], "wall_s": round(wall, 3)}))
    finally:
        await a.shutdown()
        await b.shutdown()

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


def _run(setting: dict[str, str], size: int, calls: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOGC", "GOMEMLIMIT")} | setting
    done = subprocess.run([sys.executable, "-c", _CHILD, str(size), str(calls)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the daemons' run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=500_000, help="bytes per call (default 500000)")
    parser.add_argument("--calls", type=int, default=100, help="calls per run (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting, alternating (default 3)")
    parser.add_argument("--name", default="daemon_gc", help="results/<name>.json")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.bytes <= 0 or args.calls <= 0 or args.repeats <= 0:
        parser.error("--bytes, --calls and --repeats must be positive")
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for repeat in range(args.repeats):
        for name, setting in SETTINGS.items():
            runs[name].append(_run(setting, args.bytes, args.calls))
            print(f"repeat {repeat + 1}/{args.repeats} {name}: {runs[name][-1]}", flush=True)
    summary = {
        name: {
            "settings": SETTINGS[name],
            "median_daemon_cpu_s": round(statistics.median(sum(r["daemon_cpu_s"]) / 2 for r in rs), 3),
            "median_daemon_peak_mb": statistics.median(max(r["daemon_peak_mb"]) for r in rs),
            "median_wall_s": statistics.median(r["wall_s"] for r in rs),
        }
        for name, rs in runs.items()
    }
    summary["join_cpu_over_default"] = round(
        summary["join"]["median_daemon_cpu_s"] / summary["go_default"]["median_daemon_cpu_s"], 3)
    path = write_result(args.name, {"args": vars(args) | {"out": str(args.out)}, "runs": runs, "summary": summary},
                        directory=args.out)  # fmt: skip
    print(path)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
