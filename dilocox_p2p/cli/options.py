"""Flags shared by the subcommands that build a run config (join, demo, config show)."""

from __future__ import annotations

import argparse
from typing import Any

from ..config import Config, load_config, parse_override

__all__ = ["OneLineParser", "add_config_flags", "config_from_args"]


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (and exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

# flag dest -> dotted config key
_FLAG_KEYS = {
    "run_id": "run.run_id",
    "seed": "run.seed",
    "rounds": "run.rounds",
    "run_dir": "run.run_dir",
    "checkpoint_every": "run.checkpoint_every",
    "device": "run.device",
    "devices": "run.devices",
    "replicas": "run.replicas",
    "preset": "model.preset",
    "stages": "model.stages",
    "seq_len": "model.seq_len",
    "data": "data.paths",
    "data_seed": "data.seed",
    "inner_steps": "inner.steps",
    "batch_size": "inner.batch_size",
    "microbatches": "inner.microbatches",
    "inner_lr": "inner.lr",
    "mode": "outer.mode",
    "outer_lr": "outer.lr",
    "fragments": "outer.fragments",
    "overlap_steps": "outer.overlap_steps",
    "merge_alpha": "outer.merge_alpha",
    "compression": "compression.kind",
    "initial_peers": "swarm.initial_peers",
    "host_maddrs": "swarm.host_maddrs",
    "announce_maddrs": "swarm.announce_maddrs",
    "min_peers": "swarm.min_peers",
    "round_wait": "swarm.round_wait",
    "identity": "swarm.identity",
    "certificate": "swarm.certificate",
    "progress": "control.progress",
    "log_level": "control.log_level",
    "log_format": "control.log_format",
    "control_addr": "control.control_addr",
    "metrics_addr": "control.metrics_addr",
    "operator_keys": "control.operator_keys",
    "auto_relay": "swarm.auto_relay",
    "reachability": "swarm.reachability",
}


def add_config_flags(parser: argparse.ArgumentParser, *, swarm: bool = True) -> None:
    g = parser.add_argument_group("run config (flags override the --config file)")
    g.add_argument("--config", metavar="FILE", help="TOML config file (see `dilocox-peer config show`)")
    g.add_argument("--run-id", help="name of the run; peers of one run must use the same")
    g.add_argument("--seed", type=int, help="model initialization seed (same on every peer)")
    g.add_argument("--rounds", type=int, help="outer rounds the run lasts")
    g.add_argument("--run-dir", metavar="DIR", help="checkpoints, metrics.jsonl and logs go here (default runs/RUN_ID)")
    g.add_argument("--checkpoint-every", type=int, metavar="K", help="checkpoint every K rounds (default 1)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where inner training runs (default auto)")
    g.add_argument("--devices", nargs="+", metavar="cuda:N",
                   help="the GPU of each stage, in stage order (default: stage s on cuda:s)")
    g.add_argument("--replicas", type=int, metavar="D",
                   help="copies of the pipeline inside this peer, each training 1/D of every batch (default 1)")
    g.add_argument("--preset", help="model size: tiny, small, 125m, 350m, 1b")
    g.add_argument("--stages", type=int, help="pipeline stages (processes) of this peer")
    g.add_argument("--seq-len", type=int, help="context length in bytes (default: the preset's)")
    g.add_argument("--data", nargs="+", metavar="PATH|GLOB", help="text files/dirs/globs (default: the Python stdlib)")
    g.add_argument("--data-seed", type=int, help="this peer's sampling seed (default: random, kept in the run dir)")
    g.add_argument("--inner-steps", type=int, metavar="H", help="inner steps per round")
    g.add_argument("--batch-size", type=int, help="sequences per inner step")
    g.add_argument("--microbatches", type=int, help="pipeline micro-batches per inner step")
    g.add_argument("--inner-lr", type=float, help="peak AdamW learning rate")
    g.add_argument(
        "--mode", choices=["sync", "delayed", "eager", "own", "streaming"], help="outer mode (default sync; README: Outer loop)"
    )
    g.add_argument(
        "--outer-lr", type=float,
        help="outer Nesterov lr (default: sync 1.0, delayed 0.1, eager 0.2, own 0.35, streaming 0.7)",
    )  # fmt: skip
    g.add_argument("--fragments", type=int, metavar="P", help="streaming: layer-group fragments that sync in turn (default 1)")
    g.add_argument(
        "--overlap-steps", type=int, metavar="TAU", help="streaming: inner steps an all-reduce may overlap (default min(5, H / P))"
    )
    g.add_argument("--merge-alpha", type=float, help="streaming: weight kept by the local weights on merge (default 0.5)")
    g.add_argument(
        "--compression",
        choices=["none", "fp16", "int8", "fp4", "lowrank", "topk"],
        help="how pseudo-gradients travel (default none: fp32); see compression.* in `config show`",
    )
    g.add_argument("--progress", choices=["auto", "bar", "lines", "off"], help="progress display")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    g.add_argument("--log-format", choices=["text", "json"], help="text lines (default) or one JSON object per line")
    g.add_argument(
        "--control-addr", metavar="HOST:PORT",
        help="PeerControl gRPC + health for `dilocox-peer status` (default 127.0.0.1:0, written to RUN_DIR/control.addr)",
    )  # fmt: skip
    g.add_argument(
        "--operator-keys", nargs="+", metavar="HEX",
        help="operator public keys (from `dilocox-peer keygen`) whose signed requests --control-addr serves from other "
        "hosts (default: none, loopback only)",
    )  # fmt: skip
    g.add_argument("--metrics-addr", metavar="HOST:PORT", help="serve Prometheus metrics at /metrics (default: off)")
    g.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="any other config field, e.g. --set inner.warmup_steps=100 (repeatable)",
    )
    if swarm:
        s = parser.add_argument_group("swarm")
        s.add_argument(
            "--initial-peers",
            nargs="+",
            metavar="MADDR",
            help="multiaddrs of live peers, e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...; none starts a new swarm",
        )
        s.add_argument(
            "--host-maddrs", nargs="+", metavar="MADDR", help="listen addresses (default /ip4/0.0.0.0/tcp/0)"
        )
        s.add_argument(
            "--announce-maddrs", nargs="+", metavar="MADDR", help="addresses other machines should dial (public IP/NAT)"
        )
        s.add_argument(
            "--auto-relay", action="store_true", default=None,
            help="behind a NAT without port forwarding: be reachable through relays among --initial-peers",
        )  # fmt: skip
        s.add_argument(
            "--reachability", choices=["auto", "public", "client"],
            help="auto (default): behind a NAT, average as a client member (reduce nothing, lead no group); "
                 "public or client: always a full or a client member",
        )  # fmt: skip
        s.add_argument("--min-peers", type=int, metavar="N", help="wait for N peers (this one included) before training")
        s.add_argument("--round-wait", type=float, metavar="S", help="most seconds a fast peer waits for slow ones per round")
        s.add_argument(
            "--identity", metavar="FILE", help="this peer's key from `dilocox-peer keygen` (default: one kept in RUN_DIR)"
        )
        s.add_argument("--certificate", metavar="FILE", help="closed runs: this peer's certificate (`dilocox-peer certify`)")
        s.add_argument(
            "--no-swarm", dest="swarm_enabled", action="store_false", default=None, help="train alone, without a DHT"
        )


def config_from_args(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
    overrides: dict[str, Any] = dict(extra or {})
    for text in args.set:
        key, value = parse_override(text)
        overrides[key] = value
    if getattr(args, "swarm_enabled", None) is False:
        overrides["swarm.enabled"] = False
    for dest, key in _FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = value
    return load_config(args.config, overrides)
