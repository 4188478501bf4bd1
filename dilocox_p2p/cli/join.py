"""`dilocox-peer join`: train as one peer of a run (a lone peer when no --initial-peers)."""

from __future__ import annotations

import argparse

from .options import add_config_flags, config_from_args

HELP = "train as one peer of a run: spawns one process per pipeline stage"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("join", help=HELP, description=HELP)
    add_config_flags(p)
    p.add_argument(
        "--resume", nargs="?", const="yes", choices=["yes", "auto"], default="no",
        help="continue the run in --run-dir from its last checkpoint; `--resume auto` continues it when there is one "
        "and starts the run otherwise (for services and containers that restart)",
    )  # fmt: skip
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from ..checkpoint import latest_common_round  # torch and the pipeline: only for the commands that train
    from ..launch import run_peer

    cfg = config_from_args(args)
    resume = args.resume == "yes"
    if args.resume == "auto":
        resume = (cfg.run.path / "run.json").exists() and latest_common_round(cfg.run.path, cfg.model.stages) is not None
    return run_peer(cfg, resume=resume)
