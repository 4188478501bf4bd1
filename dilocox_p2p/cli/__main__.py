"""Entry point of `dilocox-peer`; maps user errors to one line and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys

from .. import __version__
from ..errors import DilocoxError
from ..logs import init_logging
from . import config_cmd, demo, doctor, health, join, keys, plot, status
from .options import OneLineParser as _Parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dilocox-peer",
        description="Decentralized DiLoCoX pre-training: join a swarm of GPU clusters as one peer.",
    )
    parser.add_argument("--version", action="version", version=f"dilocox-p2p {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    join.add_parser(sub)
    status.add_parser(sub)
    health.add_parser(sub)
    demo.add_parser(sub)
    config_cmd.add_parser(sub)
    plot.add_parser(sub)
    keys.add_parsers(sub)
    doctor.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_logging(getattr(args, "log_level", None) or "info", fmt=getattr(args, "log_format", None) or "text")
    try:
        return int(args.func(args) or 0)
    except DilocoxError as e:
        print(f"dilocox-peer: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # `dilocox-peer status | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("dilocox-peer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
