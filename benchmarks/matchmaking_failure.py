"""What a member whose matchmaking fails costs the others, in a network-namespace lab (issues 37 and 39).

    sudo python benchmarks/matchmaking_failure.py                         # the 1 Gbit/s GPU setting's link
    sudo python benchmarks/matchmaking_failure.py --compressions default none topk    # side by side

In the netns benchmark of 2026-11-25 (docs/benchmarks.md section 1) one peer's matchmaking failed while the three
others had counted it in, and they waited out 125 s of deadlines. Here host 0 runs `dilocox-bootstrap` and hosts
1..N a peer each on --rate Mbit/s links (69.6: the lab link of the 1 Gbit/s GPU setting, benchmarks/netns/gpu.py),
`tiny` in one stage, `sync`, join's default compression unless --compressions says otherwise (one run each), with join's default
deadlines. The last peer gives up on its leader's ACCEPTED while the leader counts it in (fault injection
`abandon_accepted`) in --faulty rounds. Per other member: its exchange seconds (the all-reduce window of
metrics.jsonl) in the rounds the faulty member was left out of, against the median of the clean rounds; the
acceptance is at most 2x. Every round's group is found by matchmaking (`swarm.reuse_groups=false`): the fault is in
it, and a steady group formed again without it (swarm/group_reuse.py) would never meet the fault. Writes
benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.netlab import NetLab  # noqa: E402
from benchmarks.netns.runner import ROOT  # noqa: E402


def _join(args: argparse.Namespace, compression_kind: str, host: int, run_dir: Path, boot: str) -> list[str]:
    compression = ["--compression", compression_kind] if compression_kind != "default" else []
    return [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", "mmfail", "--preset", "tiny", "--stages", "1",
            "--rounds", str(args.rounds), "--inner-steps", "20", "--mode", "sync", *compression, "--progress", "lines",
            "--device", "cpu", "--set", "inner.threads=1", "--min-peers", str(args.peers), "--run-dir", str(run_dir),
            "--data-seed", str(host), "--initial-peers", boot, "--host-maddrs", "/ip4/0.0.0.0/tcp/0",
            "--set", "swarm.reuse_groups=false"]  # fmt: skip


def run(args: argparse.Namespace, compression_kind: str, root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    hosts = range(1, 1 + args.peers)
    faulty_host = hosts[-1]
    faults = ";".join(f"abandon_accepted:round={r}:stage=0" for r in args.faulty)
    procs: dict[int, subprocess.Popen] = {}
    with NetLab(n_hosts=1 + args.peers, rate_mbit=args.rate) as lab:
        boot = lab.start_bootstrap(0, root / "bootstrap", env={"PYTHONPATH": str(ROOT)})
        try:
            for host in hosts:
                extra = {"DILOCOX_FAULTS": faults} if host == faulty_host else {}
                procs[host] = lab.popen(host, _join(args, compression_kind, host, root / f"peer{host}", boot), cwd=ROOT, env={**env, **extra},
                                        stdout=open(root / f"peer{host}.out", "w"), stderr=subprocess.STDOUT)  # fmt: skip
            common.wait_all(procs, args.timeout)
        finally:
            common.stop_all(procs)
    return _summary(root, hosts, faulty_host, {h: p.returncode for h, p in procs.items()})


def _summary(root: Path, hosts: range, faulty_host: int, codes: dict[int, int | None]) -> dict:
    faulty = {r["applied_round"]: r["kinds"][0] for r in common.records(root / f"peer{faulty_host}") if r["applied_round"] is not None}
    hit = sorted(t for t, kind in faulty.items() if kind not in ("averaged", "partial", "mended"))  # left out of the group
    members, ratios = {}, []
    hashes = {}
    for host in hosts:
        records = [r for r in common.records(root / f"peer{host}") if r["applied_round"] is not None]
        hashes[host] = {r["applied_round"]: r["stage_hashes"] for r in records}
        if host == faulty_host:
            continue
        seconds = {r["applied_round"]: r["allreduce_windows"][0][1] - r["allreduce_windows"][0][0] for r in records
                   if r["allreduce_windows"][0] is not None}  # fmt: skip
        clean = [s for t, s in seconds.items() if t not in hit and t > 0]
        median = statistics.median(clean) if clean else None
        worst = max((seconds[t] for t in hit if t in seconds), default=None)
        phases = {r["applied_round"]: r["exchange_phases"][0] for r in records}
        worst_round = next((t for t in hit if t in seconds and seconds[t] == worst), None)
        ratio = worst / median if worst is not None and median else None
        if ratio is not None:
            ratios.append(ratio)
        members[f"peer{host}"] = {"median_clean_exchange_s": median and round(median, 3),
                                  "worst_hit_exchange_s": worst and round(worst, 3), "ratio": ratio and round(ratio, 2),
                                  "worst_hit_round": worst_round, "worst_hit_phases": phases.get(worst_round),
                                  "median_clean_phases": _median_phases([phases[t] for t in seconds if t not in hit and t > 0]),
                                  "deadlines_last": records[-1].get("deadlines") if records else None}  # fmt: skip
    common_rounds = set.intersection(*(set(h) for h in hashes.values())) if hashes else set()
    return {
        "exit_codes": codes,
        "rounds_the_faulty_member_was_left_out": hit,
        "members": members,
        "worst_ratio": round(max(ratios), 2) if ratios else None,
        "hashes_equal_every_common_round": all(len({str(h[t]) for h in hashes.values()}) == 1 for t in common_rounds),
        "common_rounds": len(common_rounds),
    }


def _median_phases(phases: list[dict | None]) -> dict[str, float]:
    """Each phase's median seconds over rounds (exchange_phases of metrics.jsonl)."""
    names = sorted({k for p in phases if p for k in p})
    return {k: round(statistics.median([(p or {}).get(k, 0.0) for p in phases]), 3) for k in names} if phases else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rate", type=float, default=69.6, help="every peer's link rate, Mbit/s (69.6: the 1 Gbit/s setting)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--faulty", type=int, nargs="+", default=[3, 5, 7], help="rounds the last peer gives up on its leader")
    p.add_argument("--compressions", nargs="+", default=["default"],
                   help="the peers' --compression, one run each in this order (default: join's)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--name", default="matchmaking_failure")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args(argv)
    variants = {kind: kind for kind in args.compressions}
    return common.run_variants(args, variants, lambda kind, tmp: run(args, kind, tmp), prefix="mmfail-")


if __name__ == "__main__":
    sys.exit(main())
