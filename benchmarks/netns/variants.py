"""What runs in each lab setting: the variants, their outer lr / momentum, and each peer's command line.

Ours runs `dilocox-peer join --stages 1` (as modes.py does); the anchors run benchmarks/netns/baselines.py,
which trains the same model, data and inner optimizer. Each compression strategy runs in its best mode
where a quality sweep measured one (benchmarks/results/modes_quality.json, convergence.json: the
project's outer loop and codecs at equal tokens, network left out), else in join's default mode at its
defaults; `Variant.why` says which, and the harness records it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from benchmarks.common import RESULTS
from dilocox_p2p.config import default_overlap_steps, load_config

__all__ = ["OuterChoice", "RunShape", "VARIANTS", "Variant", "mode_and_compression", "outer_choice", "peer_cmd"]

Kind = Literal["nocomm", "ours", "ddp", "hivemind"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunShape:
    """What every variant of one setting trains: equal tokens per peer (rounds x H x batch x seq)."""

    peers: int
    preset: str
    rounds: int
    inner_steps: int
    batch_size: int
    warmup: int
    max_steps: int = 0
    """Anchors only: stop after this many inner steps (0: all rounds x H), one record per step."""
    gpu_inner_steps: int = 0
    """H of the GPU setting the lab stands for (0: the lab's own): streaming's tau is scaled to the lab's H."""

    def overlap_steps(self, fragments: int, share: float | None = None) -> int:
        """Streaming's tau in the lab: join's default at the GPU setting's H (config.default_overlap_steps), or
        `share` of its sync rounds, as the same share of a sync round at the lab's H, so that the lab hides what
        the GPU setting would (at least 1 step)."""
        gpu_h = self.gpu_inner_steps or self.inner_steps
        sync_steps = gpu_h // fragments
        gpu_tau = default_overlap_steps(sync_steps) if share is None else max(1, round(share * sync_steps))
        return max(1, round(gpu_tau * self.inner_steps / gpu_h))

    @property
    def tokens_per_round(self) -> int:
        seq_len = load_config(overrides={"model.preset": self.preset, "model.stages": 1}).model.shape.seq_len
        return self.inner_steps * self.batch_size * seq_len


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    kind: Kind
    flags: tuple[str, ...] = ()
    """`join` flags of the mode and compression (ours)."""
    quality: str = ""
    """Result file (under benchmarks/results/) holding this configuration's best outer lr / momentum."""
    label: str = ""
    """The configuration's name in that file."""
    why: str = ""
    overlap_share: float | None = None
    """streaming: tau as this share of a sync round (None: join's default at the GPU setting's H)."""


_STREAMING = "not in the quality sweeps: streaming P=1 (join's default mode until 2026-12-02) at its defaults"
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("nocomm", "nocomm", why="the same peers alone (`join --no-swarm`): the upper bound; calibrates the links"),
    Variant("ddp-gloo", "ddp", why="DDP-style: gloo all_reduce of the gradients every inner step (no backward overlap)"),
    Variant("hivemind-fp16", "hivemind",
            why="OpenDiLoCo-style: hivemind DecentralizedAverager, fp16, blocking, every H steps; outer Nesterov"),
    Variant("sync-fp32", "ours", ("--mode", "sync", "--compression", "none"), "modes_quality.json", "sync fp32",
            "classic DiLoCo through our swarm"),
    Variant("fp16", "ours", ("--mode", "streaming", "--compression", "fp16"), why=_STREAMING),
    Variant("int8", "ours", ("--mode", "streaming", "--compression", "int8"),
            why="join's defaults from 2026-11-29 to 2026-12-02: streaming P=1, tau 5, int8"),
    Variant("fp4", "ours", ("--mode", "streaming", "--fragments", "2", "--compression", "fp4"),
            "modes_quality.json", "streaming P2 fp4",
            "fp4's best measured: streaming P=2 (modes_quality.json; modes.json: fastest to the loss at 2 Mbit/s)"),
    Variant("lowrank", "ours", ("--mode", "delayed", "--compression", "lowrank"), "convergence.json", "delayed lowrank",
            "the only low-rank configuration measured (convergence.json)"),
    Variant("topk", "ours", ("--mode", "sync", "--compression", "topk"), "convergence.json", "sync topk",
            "top-k's best measured: sync (convergence.json: 2.212, delayed 2.514)"),
    Variant("int8-tau-half", "ours", ("--mode", "streaming", "--compression", "int8"),
            why="streaming int8 with tau half a sync round (H/2)", overlap_share=0.5),
    Variant("int8-tau-3q", "ours", ("--mode", "streaming", "--compression", "int8"),
            why="streaming int8 with tau three quarters of a sync round", overlap_share=0.75),
    Variant("default-fp32", "ours", ("--mode", "streaming", "--compression", "none"),
            why="join's defaults before 2026-11-29: streaming P=1, tau 5, fp32"),
    Variant("default", "ours", why="join's defaults, no mode or compression flag: sync, int8, outer lr 1.0 / momentum 0.7 "
            "(the only mode within 2% of sync fp32 on the quality lab's long horizon: docs/benchmarks.md, section 7)"),
)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class OuterChoice:
    lr: float
    momentum: float
    source: str
    tuned: bool
    """True: passed to the peers from a sweep; False: the peers' own defaults (nothing passed)."""


@cache
def _quality(name: str) -> dict:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else {}


def outer_choice(variant: Variant, *, hivemind_lr: float, hivemind_momentum: float) -> OuterChoice | None:
    """The outer lr / momentum a variant runs at, and where they come from (None: no outer step)."""
    if variant.kind in ("nocomm", "ddp"):
        return None
    if variant.kind == "hivemind":
        return OuterChoice(hivemind_lr, hivemind_momentum, "OpenDiLoCo's outer Nesterov (flags)", True)
    best = _quality(variant.quality).get("results", {}).get(variant.label, {}).get("best") if variant.quality else None
    if best is not None:
        return OuterChoice(best["outer_lr"], best["outer_momentum"], f"best of {variant.quality} ({variant.label})", True)
    cfg = load_config(overrides=_flag_overrides(variant.flags))  # the defaults join resolves for these flags
    where = f"{variant.quality} lacks {variant.label!r}: " if variant.quality else ""
    return OuterChoice(cfg.outer.effective_lr, cfg.outer.effective_momentum, f"{where}the mode's defaults", False)


def _flag_overrides(flags: tuple[str, ...]) -> dict:
    keys = {"--mode": "outer.mode", "--compression": "compression.kind", "--fragments": "outer.fragments",
            "--overlap-steps": "outer.overlap_steps"}  # fmt: skip
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    return {keys[f]: int(v) if v.isdigit() else v for f, v in pairs.items()}


def mode_and_compression(variant: Variant) -> tuple[str, str, int]:
    """(mode as reported, compression, sync rounds per round of H steps) of an ours variant."""
    if variant.kind == "ddp":
        return "ddp (every step)", "none", 1
    if variant.kind == "hivemind":
        return "blocking (OpenDiLoCo)", "fp16 (hivemind)", 1
    cfg = load_config(overrides=_flag_overrides(variant.flags))
    mode = f"{cfg.outer.mode} P={cfg.outer.fragments}" if cfg.outer.mode == "streaming" else cfg.outer.mode
    if variant.kind == "nocomm":
        return f"{mode}, alone", "-", cfg.outer.syncs_per_round
    return mode, cfg.compression.kind, cfg.outer.syncs_per_round


def peer_cmd(
    shape: RunShape, variant: Variant, outer: OuterChoice | None, *, host: int, ip: str, leader_ip: str, run_dir: Path
) -> list[str]:
    """The command of one peer of `variant`; the harness appends `--initial-peers` for peers after the first."""
    common = ["--run-dir", str(run_dir), "--preset", shape.preset, "--rounds", str(shape.rounds),
              "--inner-steps", str(shape.inner_steps), "--batch-size", str(shape.batch_size)]  # fmt: skip
    if variant.kind in ("ddp", "hivemind"):
        kind = "ddp" if variant.kind == "ddp" else "hivemind-fp16"
        cmd = [sys.executable, "-m", "benchmarks.netns.baselines", kind, *common, "--host", str(host),
               "--peers", str(shape.peers), "--ip", ip, "--leader-ip", leader_ip, "--warmup", str(shape.warmup),
               "--max-steps", str(shape.max_steps)]  # fmt: skip
        if outer is not None:
            cmd += ["--outer-lr", str(outer.lr), "--outer-momentum", str(outer.momentum)]
        return cmd
    cmd = [
        sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", f"netns-{variant.name}", *common, "--stages", "1",
        "--device", "cpu", "--progress", "lines", "--log-level", "warning", "--data-seed", str(host),
        "--host-maddrs", f"/ip4/{ip}/tcp/0", "--set", "inner.threads=1", "--set", f"inner.warmup_steps={shape.warmup}",
    ]  # fmt: skip
    if variant.kind == "nocomm":
        return [*cmd, "--no-swarm"]
    cmd += ["--min-peers", str(shape.peers), "--round-wait", "60", "--set", "swarm.allreduce_timeout=300",
            "--set", "swarm.chunk_timeout=60", *variant.flags]  # fmt: skip
    if outer is not None and outer.tuned:
        cmd += ["--outer-lr", str(outer.lr), "--set", f"outer.momentum={outer.momentum}"]
    cfg = load_config(overrides=_flag_overrides(variant.flags))
    if cfg.outer.mode == "streaming":
        cmd += ["--overlap-steps", str(shape.overlap_steps(cfg.outer.fragments, variant.overlap_share))]
    return cmd
