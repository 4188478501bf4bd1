"""`dilocox-peer doctor`: preflight checks before `join`, one PASS / WARN / FAIL line each.

Takes the same flags as `join` (so an operator can swap the word `join` for `doctor`) and
checks that this machine can join with them: its ports are free, the initial peers can
dial it back at the addresses it will announce, each initial peer is reachable and a
dilocox node speaking our protocol, the clock agrees with theirs, and the preset fits the
device's memory and the run directory's disk. Exit code 0 only when no check fails.

    dilocox-peer doctor --initial-peers /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW... --preset 125m --stages 2
    dilocox-peer doctor --config peer.toml --json
"""

from __future__ import annotations

import argparse
import json

from .options import add_config_flags, config_from_args

HELP = "check before joining: ports, addresses, initial peers (reachable, dilocox, same protocol), clock, memory, disk"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p)
    p.add_argument("--json", action="store_true", help="print the checks as one JSON list")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for each initial peer (default 5)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..doctor import run_checks  # grpc, multiaddr (and for the probes torch, hivemind): only when it runs

    cfg = config_from_args(args)
    checks = run_checks(cfg, timeout=args.timeout)
    if args.json:
        print(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        for check in checks:
            print(check.line(), flush=True)
    failed = sum(c.status == "FAIL" for c in checks)
    if not args.json:
        print(f"{failed} check(s) failed" if failed else "all checks passed: ready to join")
    return 1 if failed else 0
