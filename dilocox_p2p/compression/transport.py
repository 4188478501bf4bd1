"""How a stage's compressed messages travel: through the compressed butterfly or all-gathered.

    butterfly_from(cfg)      # the smallest group whose phase-1 messages ride the butterfly (0: none)
    rides_butterfly(cfg, n)  # whether they do in a group of n
    reduced_config(cfg)      # how a reducer encodes its span's mean

The quantizers (fp16, int8, fp4) always ride the compressed butterfly (butterfly.py). Top-k rides it as
`compression.topk_transport` says: auto (the default) from groups of TOPK_BUTTERFLY_FROM on, where it sends
fewer bytes than the all-gather (docs/benchmarks.md, sections 5 and 6). Low-rank is encoded once its group
formed and rides the butterfly then, for both of its phases (swarm/compressed_round.py).
"""

from __future__ import annotations

import dataclasses

from ..config import CompressionConfig

__all__ = ["BUTTERFLY_KINDS", "TOPK_BUTTERFLY_FROM", "butterfly_from", "reduced_config", "rides_butterfly"]

BUTTERFLY_KINDS = frozenset({"fp16", "int8", "fp4"})
"""Compression kinds whose one message always rides the compressed butterfly."""
TOPK_BUTTERFLY_FROM = 4
"""compression.topk_transport = "auto": the smallest group where top-k rides the butterfly. Below it the all-gather's
N-1 messages are fewer bytes than the butterfly's (N-1)/N (1 + 2.4) at topk_reduced_multiple 3 (2 against 2.27)."""


def butterfly_from(cfg: CompressionConfig) -> int:
    """The smallest group whose phase-1 messages ride the compressed butterfly from the group's first step; 0: none
    (low-rank is scattered once its group formed). A phase-1 message says so in its header (`butterfly_from`)."""
    if cfg.kind in BUTTERFLY_KINDS:
        return 1
    if cfg.kind == "topk":
        return {"butterfly": 1, "auto": TOPK_BUTTERFLY_FROM}.get(cfg.topk_transport, 0)
    return 0


def rides_butterfly(cfg: CompressionConfig, group_size: int) -> bool:
    """Whether phase-1 messages under `cfg` ride the compressed butterfly in a group of `group_size`."""
    return 0 < butterfly_from(cfg) <= group_size


def reduced_config(cfg: CompressionConfig) -> CompressionConfig:
    """How a reducer of the compressed butterfly encodes its span's mean: as a message, but top-k keeps
    `topk_reduced_multiple` times as many values of each chunk."""
    if cfg.kind != "topk" or cfg.topk_reduced_multiple == 1:
        return cfg
    return dataclasses.replace(cfg, topk_density=min(1.0, cfg.topk_density * cfg.topk_reduced_multiple))
