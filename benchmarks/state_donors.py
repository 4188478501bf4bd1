"""Joiners taking the swarm's state from one donor or in pieces from several, in a network-namespace lab (issue 39).

    sudo python benchmarks/state_donors.py                          # state_donors 1 and 8, side by side
    sudo python benchmarks/state_donors.py --donor-rate 4 --joiners 4 --name state_donors_4

Host 0 runs `dilocox-bootstrap`; hosts 1..D a donor each, whose link is shaped to --donor-rate Mbit/s (a home
uplink); hosts D+1.. a joiner each, on --rate Mbit/s links. The donors train `tiny` (--preset) in one stage; once
they reach round 2, every joiner starts at once with `--set swarm.state_donors=K`, takes the state and trains two
rounds; then every peer stops. Per variant K: each joiner's download seconds (its log: "took the state of round
N from M donor(s) in S s"), the bytes each donor served (metrics.jsonl `state_donors`, over all joiners) and
whether each joiner's hashes equal the donors' at every common round. Run once per --state-donors value, one
after the other in one invocation (ratios within one run, never across days). Writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.netlab import NetLab  # noqa: E402
from benchmarks.netns.runner import ROOT  # noqa: E402

TOOK = re.compile(r"took the state of round (\d+) from (\d+) donor\(s\) in ([0-9.]+) s")


def _join(args: argparse.Namespace, host: int, run_dir: Path, boot: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", "donors", "--preset", args.preset,
            "--stages", "1", "--rounds", "500", "--inner-steps", "10", "--mode", "delayed", "--round-wait", "20",
            "--progress", "lines", "--device", "cpu", "--set", "inner.threads=1", "--run-dir", str(run_dir),
            "--data-seed", str(host), "--initial-peers", boot, "--host-maddrs", "/ip4/0.0.0.0/tcp/0", *extra]  # fmt: skip


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:.0f} s")
        time.sleep(0.5)


def run(args: argparse.Namespace, donors_asked: int, root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    donor_hosts = range(1, 1 + args.donors)
    joiner_hosts = range(1 + args.donors, 1 + args.donors + args.joiners)
    procs: dict[int, subprocess.Popen] = {}
    with NetLab(n_hosts=1 + args.donors + args.joiners, rate_mbit=args.rate) as lab:
        for host in donor_hosts:
            lab.set_rate(host, args.donor_rate)
        boot = lab.start_bootstrap(0, root / "bootstrap", env={"PYTHONPATH": str(ROOT)})
        try:
            for host in donor_hosts:
                cmd = _join(args, host, root / f"peer{host}", boot, "--min-peers", str(args.donors))
                procs[host] = lab.popen(host, cmd, stdout=open(root / f"peer{host}.out", "w"), stderr=subprocess.STDOUT,
                                        cwd=ROOT, env=env)  # fmt: skip
            _wait(lambda: any(r["round"] >= 1 for r in common.records(root / "peer1")), args.timeout, "the donors reached round 2")
            for host in joiner_hosts:
                cmd = _join(args, host, root / f"peer{host}", boot, "--set", f"swarm.state_donors={donors_asked}")
                procs[host] = lab.popen(host, cmd, stdout=open(root / f"peer{host}.out", "w"), stderr=subprocess.STDOUT,
                                        cwd=ROOT, env=env)  # fmt: skip
            _wait(lambda: all(len(common.records(root / f"peer{h}")) >= 2 for h in joiner_hosts), args.timeout,
                  "every joiner trained two rounds")  # fmt: skip
        finally:
            common.stop_all(procs)
    return _summary(root, donor_hosts, joiner_hosts)


def _summary(root: Path, donor_hosts: range, joiner_hosts: range) -> dict:
    theirs = {r["round"]: r["stage_hashes"] for r in common.records(root / f"peer{donor_hosts[0]}")}
    served: dict[str, int] = {}
    joiners = {}
    for host in joiner_hosts:
        records = common.records(root / f"peer{host}")
        for r in records:
            for donor, n in (r.get("state_donors") or [{}])[0].items():
                served[donor] = served.get(donor, 0) + n
        log = (root / f"peer{host}" / "logs" / "stage0.log").read_text()
        took = [(int(a), int(b), float(c)) for a, b, c in TOOK.findall(log)]
        common_rounds = [r["round"] for r in records if r["round"] in theirs]
        joiners[f"joiner{host}"] = {
            "downloads": [{"round": a, "donors": b, "seconds": c} for a, b, c in took],
            "hashes_equal_every_common_round": all(r["stage_hashes"] == theirs[r["round"]] for r in records
                                                   if r["round"] in theirs),  # fmt: skip
            "common_rounds": len(common_rounds),
        }
    first = [j["downloads"][0]["seconds"] for j in joiners.values() if j["downloads"]]
    total = sum(served.values())
    return {
        "first_download_seconds": {"median": round(statistics.median(first), 2) if first else None,
                                   "max": round(max(first), 2) if first else None},  # fmt: skip
        "bytes_by_donor_share": {d[-6:]: round(n / total, 3) for d, n in sorted(served.items())} if total else {},
        "joiners": joiners,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--donors", type=int, default=3)
    p.add_argument("--joiners", type=int, default=4)
    p.add_argument("--rate", type=float, default=100.0, help="the joiners' and bootstrap's link rate, Mbit/s")
    p.add_argument("--donor-rate", type=float, default=8.0, help="each donor's link rate, Mbit/s")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--state-donors", type=int, nargs="+", default=[1, 8],
                   help="swarm.state_donors of the joiners; several: one run each, in this order")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--name", default="state_donors")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args(argv)
    variants = {f"state_donors={k}": k for k in args.state_donors}
    return common.run_variants(args, variants, lambda k, tmp: run(args, k, tmp), prefix="state-donors-")


if __name__ == "__main__":
    sys.exit(main())
