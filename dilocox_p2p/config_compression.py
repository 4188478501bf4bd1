"""The configuration of how pseudo-gradients travel: the [compression] section (config.py holds the whole Config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config_checks import check_choices, fail

__all__ = ["TOPK_MAX_CHUNK", "CompressionConfig"]

TOPK_MAX_CHUNK = 1 << 20
"""The largest top-k chunk: indices within a chunk travel and are held as 32-bit integers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompressionConfig:
    kind: Literal["none", "fp16", "int8", "fp4", "lowrank", "topk"] = "int8"
    """How pseudo-gradients travel: none = fp32 through the exact butterfly; fp16, int8 (blockwise), fp4
    (E3M0 with blockwise scales, Streaming DiLoCo's outer-gradient format), lowrank (PowerSGD, quantized factors,
    adaptive rank) and topk (SparseLoCo) travel as compressed messages through the compressed butterfly
    (compression/butterfly.py; topk as topk_transport says), and every member applies the same bits. The default,
    int8, sends 3.9x fewer bytes than fp32 and stayed within 1.4% of it in every round of 300 in sync mode, where fp4
    (7.5x) reached the same target loss 0.2 h later on the 100 Mbit/s GPU setting (docs/benchmarks.md, section 7)."""
    block: int = 64
    """Values per quantization block (int8, fp4, low-rank factors, low-rank's other tensors), one bf16 scale each."""
    factor_bits: Literal[4, 8] = 4
    """Bits per value of low-rank factors and of the tensors low-rank sends whole."""
    rank: int = 4
    """Low-rank: the rank every matrix starts at."""
    rank_min: int = 1
    rank_max: int = 0
    """Low-rank: the highest rank; 0 means per matrix the highest whose two factors stay 100x
    smaller than the matrix in fp32 (at factor_bits), so that adapting never costs the ratio."""
    energy_target: float = 0.8
    """Low-rank: the share of ||delta||^2 the approximation should keep; the rank grows below it and
    shrinks well above it (halfway to 1), within [rank_min, rank_max]. 0 keeps the rank fixed."""
    topk_density: float = 1 / 64
    """Top-k: the share of each chunk kept (SparseLoCo: 64 of 4096)."""
    topk_chunk: int = 4096
    topk_bits: Literal[2, 3, 4] = 2
    """Top-k: bits per kept value (a sign bit and the rest for one of 2^(bits-1) magnitudes per chunk)."""
    topk_transport: Literal["auto", "butterfly", "gather"] = "auto"
    """Top-k: how a group's messages are averaged. auto: gather in groups of up to 3, the butterfly from 4 (where
    it sends fewer bytes: docs/benchmarks.md, section 5). butterfly: each member reduces its chunk-aligned span of the
    others' messages, keeps the top values of their mean (topk_reduced_multiple; the rest stays in its own error
    feedback) and serves them to all: bytes per member nearly flat in the group size N. gather: every member
    sends its whole message to every other and averages all N: N-1 messages out and in, each value as sent."""
    topk_reduced_multiple: int = 3
    """Top-k through the butterfly: a reducer keeps this many times k values of each chunk of its span's mean (up to
    the chunk), where N members' parts bring up to N k: bytes per member (N-1)/N x (1 + this) messages each way
    (a little less: denser chunks take fewer index bits). At 4 `tiny` peers the all-gather's loss at 3, +2.0% at
    2, +5.9% at 1; at 8 peers +1.4% at 3 (docs/benchmarks.md, section 6)."""
    feedback_decay: float = -1.0
    """Error feedback: e <- decay * e + delta before compressing; -1 means the kind's default
    (topk 0.95, where it stands in for outer momentum; 1.0 otherwise); 0 turns error feedback off."""

    def __post_init__(self) -> None:
        check_choices(self, "compression")
        if self.block < 1:
            fail("compression.block", self.block, "must be at least 1")
        top = self.rank_max or self.rank
        if not 1 <= self.rank_min <= self.rank <= top:
            fail("compression.rank", self.rank,
                  f"must satisfy 1 <= rank_min ({self.rank_min}) <= rank <= rank_max ({self.rank_max}, 0: auto)")
        if not 0.0 <= self.energy_target < 1.0:
            fail("compression.energy_target", self.energy_target, "must be in [0, 1)")
        if not 0.0 < self.topk_density <= 1.0:
            fail("compression.topk_density", self.topk_density, "must be in (0, 1]")
        if not 1 <= self.topk_reduced_multiple <= 64:
            fail("compression.topk_reduced_multiple", self.topk_reduced_multiple, "must be in [1, 64]")
        if not 1 <= self.topk_chunk <= TOPK_MAX_CHUNK:
            fail("compression.topk_chunk", self.topk_chunk, f"must be in [1, {TOPK_MAX_CHUNK}]")
        if self.feedback_decay != -1.0 and not 0.0 <= self.feedback_decay <= 1.0:
            fail("compression.feedback_decay", self.feedback_decay, "must be in [0, 1], or -1 for the kind's default")

    @property
    def effective_feedback_decay(self) -> float:
        if self.feedback_decay != -1.0:
            return self.feedback_decay
        return 0.95 if self.kind == "topk" else 1.0
