"""`dilocox-bootstrap`: run a swarm's long-lived entry point (a DHT node with a stable multiaddr).

    dilocox-bootstrap --state-dir /var/lib/dilocox-bootstrap --announce-maddrs /ip4/203.0.113.7/tcp/31337
    # stdout: the multiaddrs peers pass to `dilocox-peer join --initial-peers`, one per line, reachable
    # ones first (also in STATE_DIR/multiaddrs.txt); stderr: the log

Stops cleanly on SIGTERM or SIGINT (exit 0). Errors the user can fix (bad flags, an unsafe or
unreadable identity file, a port in use, a malformed multiaddr) are one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import DilocoxError
from ..logs import init_logging
from .options import OneLineParser

if TYPE_CHECKING:
    from ..bootstrap import BootstrapOptions

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)

PROG = "dilocox-bootstrap"


def build_parser() -> OneLineParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dilocox-p2p {__version__}")
    p.add_argument("--state-dir", type=Path, default=Path("bootstrap-state"), metavar="DIR",
                   help="holds identity.key, multiaddrs.txt and health.addr (default ./bootstrap-state)")  # fmt: skip
    p.add_argument("--identity", type=Path, metavar="FILE",
                   help="libp2p key file (default STATE_DIR/identity.key; created mode 0600 on first start, reused "
                   "after, so the peer id and multiaddrs stay the same)")  # fmt: skip
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"], metavar="MADDR",
                   help="listen addresses (default /ip4/0.0.0.0/tcp/31337: a fixed port keeps the address stable)")  # fmt: skip
    p.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                   help="addresses peers should dial, e.g. /ip4/203.0.113.7/tcp/31337 (public IP or NAT mapping)")  # fmt: skip
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                   help="other bootstrap nodes of the swarm, e.g. /ip4/198.51.100.2/tcp/31337/p2p/12D3KooW... (the "
                   "node starts though they are down, and links to each once it answers)")  # fmt: skip
    p.add_argument("--relay", action="store_true",
                   help="serve as a circuit relay for peers behind NAT (they pass --auto-relay)")  # fmt: skip
    p.add_argument("--health-addr", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="grpc.health.v1 endpoint: SERVING while the DHT node answers (default 127.0.0.1:0; the bound "
                   "address goes to STATE_DIR/health.addr)")  # fmt: skip
    p.add_argument("--metrics-addr", default="", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")  # fmt: skip
    p.add_argument("--status-period", type=float, default=10.0, metavar="S",
                   help="seconds between checks of the node: health, metrics, and the other bootstrap nodes asked "
                   "again while they are missing (default 10)")  # fmt: skip
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="text lines (default) or one JSON object per line")  # fmt: skip
    return p


def options_from_args(args: argparse.Namespace) -> BootstrapOptions:
    from ..bootstrap import BootstrapOptions

    return BootstrapOptions(
        state_dir=args.state_dir,
        identity=args.identity,
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        initial_peers=tuple(args.initial_peers),
        relay=args.relay,
        health_addr=args.health_addr,
        metrics_addr=args.metrics_addr,
        status_period=args.status_period,
    )


def _stop_on_signals(stop: threading.Event, received: list[int]) -> None:
    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_logging(args.log_level, fmt=args.log_format)
    stop, received = threading.Event(), []
    _stop_on_signals(stop, received)  # before the DHT starts: a SIGTERM during start-up still shuts it down cleanly
    from ..bootstrap import BootstrapNode  # hivemind and torch: after the flags parse (usage errors stay instant)

    try:
        node = BootstrapNode.start(options_from_args(args))
    except DilocoxError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    for maddr in node.maddrs:  # stdout holds only these, reachable ones first: scripts read them
        print(maddr, flush=True)
    try:
        code = node.serve(stop)
        if received:
            logger.info("%s received: stopping", signal.Signals(received[0]).name)
        return code
    finally:
        node.stop()


if __name__ == "__main__":
    sys.exit(main())
