"""`dilocox-peer join`: train as one peer of a run (a lone peer when no --initial-peers)."""

from __future__ import annotations

import argparse

from .options import add_config_flags, config_from_args

HELP = "train as one peer of a run: spawns one process per pipeline stage"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("join", help=HELP, description=HELP)
    add_config_flags(p)
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..launch import run_peer  # torch and the pipeline: only for the commands that train

    cfg = config_from_args(args)
    return run_peer(cfg, resume=args.resume)
