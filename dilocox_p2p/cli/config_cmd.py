"""`dilocox-peer config show`: print the effective config as TOML, with its hash."""

from __future__ import annotations

import argparse

from ..config import config_hash, to_toml
from .options import OneLineParser, add_config_flags, config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="inspect run configs", description="inspect run configs")
    inner = p.add_subparsers(dest="config_command", required=True, metavar="show", parser_class=OneLineParser)
    show = inner.add_parser("show", help="print the effective config (file + flags) as TOML")
    add_config_flags(show)
    show.set_defaults(func=show_main)


def show_main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    print(f"# config hash {config_hash(cfg)} (peers of one run must match)")
    print(to_toml(cfg), end="")
    return 0
