"""`dilocox-peer demo`: the whole system on the embedded corpus with zero set-up."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..launch import run_peer
from ..metrics import read_metrics
from .options import add_config_flags, config_from_args
from .plot import plot_runs

HELP = "train a tiny model on this machine's Python stdlib for a few minutes, then plot it"

DEMO_DEFAULTS = {
    "run.run_id": "demo",
    "run.rounds": 30,
    "model.preset": "tiny",
    "model.stages": 2,
    "inner.steps": 20,
    "inner.warmup_steps": 20,
    "run.device": "cpu",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help=HELP, description=HELP)
    add_config_flags(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    extra = dict(DEMO_DEFAULTS)
    extra["run.run_dir"] = f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = config_from_args(args, extra=extra)
    started = time.time()
    code = run_peer(cfg, resume=False)
    if code != 0:
        return code
    run_dir = cfg.run.path
    records = read_metrics(run_dir / "metrics.jsonl")
    info = json.loads((run_dir / "run.json").read_text())
    out = plot_runs([run_dir])
    last = records[-1]
    print(f"\ndemo finished in {time.time() - started:.0f}s: {len(records)} rounds x {cfg.inner.steps} inner steps, "
          f"{cfg.model.stages} pipeline stages, {info['params']:,} parameters")
    print(f"val loss {info['initial_val_loss']:.3f} -> {last['val_loss']:.3f} nats/byte, "
          f"{last['tokens_per_s']:.0f} tokens/s in the last round")
    print(f"theta_g hash per stage: {' '.join(h[:16] for h in last['stage_hashes'])}")
    print(f"metrics: {run_dir / 'metrics.jsonl'}")
    print(f"plot: {Path(out).resolve()}")
    return 0
