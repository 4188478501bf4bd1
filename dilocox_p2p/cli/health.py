"""`dilocox-peer health`: exit 0 when a peer's or bootstrap node's gRPC health service says SERVING.

    dilocox-peer health /data/run                 # a peer: RUN_DIR/control.addr
    dilocox-peer health /data/bootstrap           # a bootstrap node: STATE_DIR/health.addr
    dilocox-peer health --target 127.0.0.1:7100

Made for Docker's HEALTHCHECK and service monitors: no output when healthy, one line
otherwise, exit 1 when not serving or unreachable (exit 2 for a wrong invocation).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..endpoints import parse_hostport
from ..errors import DilocoxError

HELP = "exit 0 if a peer (RUN_DIR) or bootstrap node (STATE_DIR) reports SERVING on gRPC health"
ADDR_FILES = ("control.addr", "health.addr")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help=HELP, description=HELP)
    p.add_argument("path", nargs="?", metavar="DIR", help="a peer's RUN_DIR or a bootstrap node's --state-dir")
    p.add_argument("--target", metavar="HOST:PORT", help="the gRPC address instead of DIR")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="seconds to wait (default 3)")
    p.set_defaults(func=main)


def health_target(path: str | None, target: str | None) -> str:
    if bool(path) == bool(target):
        raise DilocoxError("give a run or state directory, or --target HOST:PORT (one of them)")
    if target:
        parse_hostport(target, flag="--target")
        return target
    for name in ADDR_FILES:
        if (Path(path) / name).exists():
            return (Path(path) / name).read_text().strip()
    raise DilocoxError(f"{path} holds no {' or '.join(ADDR_FILES)}: nothing runs there (or it has not started yet)")


def main(args: argparse.Namespace) -> int:
    target = health_target(args.path, args.target)
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            print(f"dilocox-peer health: {target}: {e.code().name.lower()}", file=sys.stderr)
            return 1
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"dilocox-peer health: {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}", file=sys.stderr)
        return 1
    return 0
