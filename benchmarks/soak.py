"""Churn soak: many peers, many rounds, seeded chaos; the swarm must stay in agreement and keep learning.

    python benchmarks/soak.py                                  # 6 peers x 2 stages, 50 rounds, 12 events
    python benchmarks/soak.py --peers 4 --rounds 26 --events 3 # the short soak (tests/netns/test_churn_soak.py, --netns)
    sudo python benchmarks/soak.py --netns                     # peers in network namespaces, + link throttling
    python benchmarks/soak.py --baseline                       # also a churn-free run of the same peers

Chaos, drawn from --seed and triggered when the swarm reaches a round:
    kill     SIGKILL of a peer's whole process group (launcher, stages, DHT, p2pd), restarted with --resume
             after --down seconds
    join     a brand-new peer (its own run dir and data seed) joins the running swarm
    freeze   SIGSTOP of a peer's process group for --freeze seconds (longer than the swarm's timeouts), SIGCONT
    throttle (--netns) one peer's link drops to --throttle-mbit for --freeze seconds, then is restored

Invariants, checked from every peer's metrics.jsonl and logs (`check`):
    group        peers that applied the average of one group (the record's `groups`) and held one state before
                 it hold one state after it: a group never splits (exchange.py, phase 5)
    agreement    at every round, a peer whose stage hash differs from the majority of the peers that completed
                 that round (most holders; a tie goes to the smallest peer id, as the swarm's hash checks decide)
                 is back on the majority's hash one round later: the hash check that finds it runs during the
                 next round, so it trains one round on a diverged state, never two
    resumption   a killed peer resumes from its last checkpoint ("resumed from round k", k >= the last round it
                 recorded) and is back in a group of >= 2 within --rejoin-rounds swarm rounds of resuming (its
                 process start-up, reported as `seconds_to_resume`, is the machine's, not the swarm's); a restart
                 killed again before it was back is superseded by the next one. `restart_to_group_s`: seconds
                 from the restart to the end of its first exchange in a group (its start-up marks)
    crashes      every peer process exits 0, except the ones the soak killed; a start that found no initial peer
                 (exit 75, temporary) is restarted as a supervisor would, at most MAX_RETRIES times
    leftovers    no process whose command line names the soak's directory survives the soak
    learning     the final val loss is below the initial one, and the last quarter's mean below the first's

Results: benchmarks/results/NAME.json (events, repairs, rounds lost per peer, seconds to rejoin, bytes,
final val loss beside the churn-free run's) and NAME.png (one row per peer: what it did each round).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.soak_chaos import (  # noqa: E402
    KINDS,
    MAX_RETRIES,
    SETTLE_ROUNDS,
    SWARM_FLAGS,
    Event,
    Soak,
    SoakPeer,
    read_records,
    schedule,
    sync_rounds_per_round,
)
from benchmarks.soak_check import (  # noqa: E402
    check,
    check_rejoins,
    final_val_loss,
    group_splits,
    leftovers,
    minority_streaks,
    reference_peer,
    restart_to_group,
    resumptions,
    summarize,
    timeline,
    worker_peer_id,
)

__all__ = [
    "KINDS", "MAX_RETRIES", "SETTLE_ROUNDS", "SWARM_FLAGS", "Event", "Soak", "SoakPeer",
    "check", "check_rejoins", "final_val_loss", "group_splits", "leftovers", "main", "minority_streaks",
    "parse_args", "read_records", "reference_peer", "restart_to_group", "resumptions", "run_soak", "schedule",
    "summarize", "sync_rounds_per_round", "timeline", "worker_peer_id",
]  # fmt: skip


def run_soak(args: argparse.Namespace, root: Path, *, chaos: bool) -> tuple[Soak, dict[str, Any]]:
    soak = Soak(args, root, chaos=chaos)
    if args.netns:
        from benchmarks.netlab import NetLab

        soak.lab = NetLab(args.peers + args.events + 1, args.rate).__enter__()
    try:
        soak.run()
    finally:
        soak.stop_all()
        if soak.lab is not None:
            soak.lab.close()
    time.sleep(1.0)
    checked = check(soak)
    left = leftovers(root)
    checked["violations"]["leftovers"] = left
    return soak, checked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=6)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--events", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--down", type=float, default=5.0, help="seconds a killed peer stays down")
    p.add_argument("--freeze", type=float, default=35.0, help="seconds a frozen peer (or a throttled link) lasts")
    p.add_argument("--rejoin-rounds", type=int, default=3,
                   help="swarm rounds a restarted peer may take, from resuming, to be back in a group")  # fmt: skip
    p.add_argument("--netns", action="store_true", help="peers in network namespaces (root), links shaped to --rate")
    p.add_argument("--rate", type=float, default=100.0, help="--netns: link rate, Mbit/s")
    p.add_argument("--throttle-mbit", type=float, default=1.0)
    p.add_argument("--baseline", action="store_true", help="also run the same peers churn-free and compare")
    p.add_argument("--run-id", default="soak")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--name", default="soak", help="results: OUT/NAME.json and .png")
    p.add_argument("--out", type=Path, default=common.RESULTS, help="results directory (default benchmarks/results)")
    p.add_argument("--keep", action="store_true", help="keep the peers' directories (printed)")
    p.add_argument("extra", nargs="*", help="after --: more `join` flags for every peer, e.g. -- --mode delayed")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally-blocks stop the peers and the lab
    root = Path(tempfile.mkdtemp(prefix="dilocox-soak-"))
    baseline = None
    if args.baseline:
        quiet = argparse.Namespace(**{**vars(args), "events": 0})
        _, base_checked = run_soak(quiet, root / "baseline", chaos=False)
        baseline = max(base_checked["records"][0].items())[1]["val_loss"]
    soak, checked = run_soak(args, root / "churn", chaos=True)
    report = summarize(soak, checked)
    report["baseline_final_val_loss"] = baseline
    if baseline is not None and report["final_val_loss"] is not None:
        report["final_val_loss_vs_baseline"] = round(report["final_val_loss"] / baseline - 1, 4)
    report["violations"] = checked["violations"]
    report["passed"] = not any(checked["violations"].values())
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path = common.write_result(args.name, report, directory=args.out)
    timeline(soak, checked, args.out / f"{args.name}.png", baseline)
    print(json.dumps({k: report[k] for k in ("final_val_loss", "baseline_final_val_loss", "violations", "passed")}, indent=2))
    print(f"[soak] results: {path}")
    if args.keep:
        print(f"[soak] peers' directories: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
