"""Fixed against learned deadlines on links too slow for the configured all-reduce deadline (issue 39, item 6).

    sudo python benchmarks/slow_link_deadlines.py                    # fixed, then learned, one invocation
    sudo python benchmarks/slow_link_deadlines.py --rate 1 --allreduce-timeout 3 --name slow_link_deadlines_1mbit

Host 0 runs `dilocox-bootstrap`; hosts 1..N a peer each behind a --rate Mbit/s link (a poor home uplink), `tiny` in
fp32 and one stage, `delayed`, with `swarm.allreduce_timeout` set below what an all-reduce takes on that link (as
the default 60 s is for a large stage on a home uplink: hivemind#676). Per variant (`swarm.deadlines` fixed or
learned): how many rounds each peer averaged in the whole group, its tokens/s over the run, the deadline it ended
with (metrics.jsonl `deadlines`), and whether the peers' hashes agree at every common round. Writes
benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.netlab import NetLab  # noqa: E402
from benchmarks.netns.runner import ROOT  # noqa: E402


def _join(args: argparse.Namespace, deadlines: str, host: int, run_dir: Path, boot: str) -> list[str]:
    return [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", "slowlink", "--preset", "tiny", "--stages", "1",
            "--rounds", str(args.rounds), "--inner-steps", "5", "--mode", "delayed", "--compression", "none",
            "--progress", "lines", "--device", "cpu", "--round-wait", "10", "--min-peers", str(args.peers),
            "--set", "inner.threads=1", "--set", f"swarm.allreduce_timeout={args.allreduce_timeout}",
            "--set", "swarm.chunk_timeout=5", "--set", f"swarm.deadlines={deadlines}", "--run-dir", str(run_dir),
            "--data-seed", str(host), "--initial-peers", boot, "--host-maddrs", "/ip4/0.0.0.0/tcp/0"]  # fmt: skip


def run(args: argparse.Namespace, deadlines: str, root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    hosts = range(1, 1 + args.peers)
    procs: dict[int, subprocess.Popen] = {}
    started = time.monotonic()
    with NetLab(n_hosts=1 + args.peers, rate_mbit=args.rate) as lab:
        boot = lab.start_bootstrap(0, root / "bootstrap", env={"PYTHONPATH": str(ROOT)})
        try:
            for host in hosts:
                procs[host] = lab.popen(host, _join(args, deadlines, host, root / f"peer{host}", boot), cwd=ROOT, env=env,
                                        stdout=open(root / f"peer{host}.out", "w"), stderr=subprocess.STDOUT)  # fmt: skip
            common.wait_all(procs, args.timeout)
        finally:
            common.stop_all(procs)
    seconds = time.monotonic() - started
    peers, hashes = {}, []
    for host in hosts:
        records = [r for r in common.records(root / f"peer{host}") if r["applied_round"] is not None]
        hashes.append({r["round"]: r["stage_hashes"] for r in records})
        tokens = records[-1]["tokens"] - records[0]["tokens"] if len(records) > 1 else 0  # cumulative in the records
        span = records[-1]["time"] - records[0]["time"] if len(records) > 1 else None
        peers[f"peer{host}"] = {
            "rounds": len(records),
            "averaged_in_the_whole_group": sum(r["kinds"] == ["averaged"] and r["group_sizes"] == [args.peers] for r in records),
            "kinds": [r["kinds"][0] for r in records],
            "tokens_per_s": round(tokens / span, 1) if span else None,
            "deadlines_last": records[-1]["deadlines"][0] if records else None,
        }
    common_rounds = set.intersection(*(set(h) for h in hashes)) if hashes else set()
    return {"exit_codes": {h: p.returncode for h, p in procs.items()}, "seconds": round(seconds, 1), "peers": peers,
            "hashes_equal_every_common_round": all(len({str(h[t]) for h in hashes}) == 1 for t in common_rounds)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--rate", type=float, default=2.0, help="every peer's link rate, Mbit/s")
    p.add_argument("--allreduce-timeout", type=float, default=1.5, help="swarm.allreduce_timeout, s (too short)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--name", default="slow_link_deadlines")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args(argv)
    variants = {kind: kind for kind in ("fixed", "learned")}
    return common.run_variants(args, variants, lambda kind, tmp: run(args, kind, tmp), prefix="slowlink-")


if __name__ == "__main__":
    sys.exit(main())
