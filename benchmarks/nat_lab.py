"""Volunteers behind NAT: what their rounds become, in a network-namespace lab (issue 39).

    sudo python benchmarks/nat_lab.py                       # 1 public bootstrap, 1 public peer, 2 peers behind NAT
    sudo python benchmarks/nat_lab.py --reachability auto public --name nat_lab_clients   # side by side
    sudo python benchmarks/nat_lab.py --auto-relay --reachability public --name nat_lab_relay

Host 0 runs `dilocox-bootstrap --relay` (public), host 1 a public peer, hosts 2 and 3 a peer each behind
its own home router (MASQUERADE, no port forwarding: benchmarks/netlab.py). Every peer joins with
`--initial-peers` of the bootstrap only, as a volunteer would, and trains `tiny` for --rounds rounds.
Per peer (summed over its stages): how each round's average was obtained (averaged: its contribution counted; borrowed: it took
the group's; mended...), group sizes, the rounds it averaged as a client member, and whether every common
round's hashes are equal. `--reachability` runs the lab once per value given (swarm.reachability: auto,
the default, makes the NATed peers client members; public keeps them full members, as before client
members existed), one after the other in one invocation. Writes benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import collections
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

PUBLIC, NATED = (1,), (2, 3)


def _join(args: argparse.Namespace, host: int, run_dir: Path, boot: str) -> list[str]:
    return [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", "nat", "--preset", "tiny", "--stages", str(args.stages),
            "--rounds", str(args.rounds), "--inner-steps", "10", "--mode", "delayed", "--min-peers", "3",
            "--round-wait", "20", "--progress", "lines", "--device", "cpu", "--set", "inner.threads=1",
            "--run-dir", str(run_dir), "--data-seed", str(host), "--initial-peers", boot,
            "--host-maddrs", "/ip4/0.0.0.0/tcp/0", "--reachability", args.variant,
            *(["--auto-relay"] if args.auto_relay else [])]  # fmt: skip


def run(args: argparse.Namespace, root: Path) -> dict:
    from dilocox_p2p.metrics import read_metrics

    env = {"PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    with NetLab(n_hosts=1 + len(PUBLIC) + len(NATED), rate_mbit=args.rate, behind_nat=NATED) as lab:
        boot = lab.start_bootstrap(0, root / "bootstrap", relay=True, env=env)
        peers = {}
        for host in (*PUBLIC, *NATED):
            log = open(root / f"peer{host}.out", "w")
            peers[host] = lab.popen(host, _join(args, host, root / f"peer{host}", boot), stdout=log,
                                    stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, **env})  # fmt: skip
        codes = {h: p.wait(args.timeout) for h, p in peers.items()}
    records = {h: read_metrics(root / f"peer{h}" / "metrics.jsonl") for h in peers}
    by_round = [{r["round"]: r["stage_hashes"] for r in recs} for recs in records.values()]
    common_rounds = sorted(set.intersection(*(set(b) for b in by_round)))
    return {
        "seconds": round(time.monotonic() - started, 1),
        "exit_codes": codes,
        "hashes_equal_every_common_round": all(len({tuple(b[t]) for b in by_round}) == 1 for t in common_rounds),
        "common_rounds": len(common_rounds),
        "peers": {
            f"{'nat' if h in NATED else 'public'}{h}": {
                "kinds": dict(collections.Counter(k for r in recs if r["applied_round"] is not None for k in r["kinds"])),
                "group_sizes": dict(collections.Counter(g for r in recs if r["applied_round"] is not None
                                                        for g in r["group_sizes"])),  # fmt: skip
                "client_rounds": sum(1 for r in recs for c in (r.get("clients") or [""]) if c),
                "seconds_per_round": round(sum(r["seconds_round"] for r in recs) / max(1, len(recs)), 2),
                "exchange_phases_mean_s": _mean_phases(recs),
            }
            for h, recs in records.items()
        },
    }


def _mean_phases(records: list[dict]) -> dict[str, float]:
    """Mean seconds of each exchange phase (metrics.jsonl `exchange_phases`, stage 0) over the averaged rounds."""
    phases = [r["exchange_phases"][0] for r in records if r["applied_round"] is not None and r.get("exchange_phases")]
    keys = sorted({k for p in phases for k in p})
    return {k: round(sum(p.get(k, 0.0) for p in phases) / len(phases), 2) for k in keys} if phases else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--rate", type=float, default=100.0, help="every link's rate, Mbit/s")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages of every peer (each behind the same NAT)")
    p.add_argument("--auto-relay", action="store_true", help="the peers join with --auto-relay")
    p.add_argument("--reachability", nargs="+", default=["auto"], choices=["auto", "public", "client"],
                   help="swarm.reachability of every peer; several: one run each, in this order")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--name", default="nat_lab")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args(argv)
    variants = {v: argparse.Namespace(**vars(args), variant=v) for v in args.reachability}
    return common.run_variants(args, variants, run, prefix="nat-lab-")


if __name__ == "__main__":
    sys.exit(main())
