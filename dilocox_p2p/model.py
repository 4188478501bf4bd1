"""Byte-level GPT (vocab 256), split into pipeline stages balanced by parameter count.

The model is a list of *units*: the embedding, one unit per transformer block, and the
head (final norm + projection). A stage is a contiguous run of units. Each unit is
initialized from its own seed (run seed, unit index), so a stage worker builds exactly
its own layers and they equal the same layers of the whole model, bit for bit.

Shapes: B = batch, T = sequence length, D = d_model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ModelShape

__all__ = ["GPT", "StageModule", "VOCAB", "build_stage", "muon_matrices", "partition_units", "stage_layout",
           "unit_param_counts"]

VOCAB = 256


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + GELU MLP."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        d = shape.d_model
        self.n_head = shape.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Embedding(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, shape.d_model)
        self.pos = nn.Embedding(shape.seq_len, shape.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, D)
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class Head(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.ln = nn.LayerNorm(shape.d_model)
        self.lm = nn.Linear(shape.d_model, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, VOCAB)
        return self.lm(self.ln(x))


def _init_unit(unit: nn.Module, seed: int, n_layer: int) -> None:
    """GPT-2 style init from a private generator: ~N(0, 0.02), residual projections scaled."""
    rng = np.random.Generator(np.random.PCG64(seed))
    for name, p in unit.named_parameters():
        with torch.no_grad():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm weight
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.split(".")[0] in ("proj", "out") else 0.02
                p.copy_(portable_normal(p.shape, rng, std=std))


_IRWIN_HALL = 4
_CHUNK = 1 << 22


def portable_normal(shape: torch.Size | tuple[int, ...], rng: np.random.Generator, *, std: float) -> torch.Tensor:
    """Near-normal values with the same bits on every CPU: theta_g starts bit-identical on every peer.

    torch's and numpy's normal samplers use vectorized or libm transcendental functions whose
    rounding differs between instruction sets (outer.py, determinism rule 1), so peers on
    different CPUs would start from different models. Here: the Irwin-Hall sum of 4 uniform
    32-bit integers (exact in any order), shifted to mean 0 and scaled to `std` with two
    separately rounded float64 operations, then cast to float32 once.
    """
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.float32)
    scale = math.sqrt(12 / _IRWIN_HALL) * std / 2**32  # std of one uniform integer: 2**32 / sqrt(12)
    for start in range(0, n, _CHUNK):
        count = min(_CHUNK, n - start)
        total = sum(rng.integers(0, 2**32, size=count, dtype=np.uint64) for _ in range(_IRWIN_HALL))
        centered = torch.from_numpy(total.astype(np.int64)).sub_(_IRWIN_HALL * 2**31).to(torch.float64)
        out[start : start + count] = centered.mul_(scale).to(torch.float32)
    return out.view(shape)


def _make_unit(index: int, shape: ModelShape, seed: int) -> nn.Module:
    n_units = shape.n_layer + 2
    if index == 0:
        unit: nn.Module = Embedding(shape)
    elif index == n_units - 1:
        unit = Head(shape)
    else:
        unit = Block(shape)
    _init_unit(unit, seed * 100_003 + index, shape.n_layer)
    return unit


def unit_param_counts(shape: ModelShape) -> list[int]:
    d = shape.d_model
    block = 12 * d * d + 13 * d  # qkv, proj, fc, out (+biases) and two LayerNorms
    return [(VOCAB + shape.seq_len) * d] + [block] * shape.n_layer + [2 * d + d * VOCAB]


def partition_units(counts: Sequence[int], n_stages: int) -> list[range]:
    """Split units into n_stages contiguous runs minimizing the largest run's parameter count.

    The embedding (first unit) and head (last unit) are never a stage of their own:
    every stage holds at least one transformer block.
    """
    n_blocks = len(counts) - 2
    if not 1 <= n_stages <= n_blocks:
        raise ValueError(f"cannot split {n_blocks} blocks into {n_stages} stages")
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    # best[k][j]: minimal max-stage size covering blocks [0, j) with k stages; stage cuts lie between blocks
    inf = float("inf")

    def cost(a: int, b: int) -> int:  # blocks [a, b), plus embedding / head on the ends
        lo = 0 if a == 0 else a + 1
        hi = len(counts) if b == n_blocks else b + 1
        return prefix[hi] - prefix[lo]

    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for j in range(k, n_blocks + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [n_blocks]
    for k in range(n_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()  # block boundaries b0=0 < b1 < ... < bM = n_blocks
    stages = []
    for s in range(n_stages):
        lo = 0 if s == 0 else bounds[s] + 1
        hi = len(counts) if s == n_stages - 1 else bounds[s + 1] + 1
        stages.append(range(lo, hi))
    return stages


def stage_layout(shape: ModelShape, n_stages: int) -> list[range]:
    """Unit indices held by each stage."""
    return partition_units(unit_param_counts(shape), n_stages)


class StageModule(nn.Module):
    """The units of one pipeline stage; stage 0 takes token ids, the last stage returns logits."""

    def __init__(self, shape: ModelShape, units: range, seed: int):
        super().__init__()
        self.units = units
        self.layers = nn.ModuleList(_make_unit(i, shape, seed) for i in units)
        self.boundary_dtype: torch.dtype | None = None  # the dtype this stage hands the next one (bf16 halves it)
        self.checkpoint_blocks = False  # recompute each block's activations in backward (less memory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            x = x.float()  # the residual stream stays fp32 whatever the previous stage sent
        for layer in self.layers:
            if self.checkpoint_blocks and self.training and isinstance(layer, Block):
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x if self.boundary_dtype is None else x.to(self.boundary_dtype)


def build_stage(shape: ModelShape, n_stages: int, stage: int, seed: int) -> StageModule:
    """Build only this stage's layers, initialized exactly as in the whole model."""
    return StageModule(shape, stage_layout(shape, n_stages)[stage], seed)


def muon_matrices(module: nn.Module) -> list[nn.Parameter]:
    """The weight matrices of the transformer blocks in `module` (a stage or the whole model): what Muon trains
    (inner.optimizer = muon); the embeddings and the output head are not among them."""
    return [layer.weight for block in module.modules() if isinstance(block, Block)
            for layer in (block.qkv, block.proj, block.fc, block.out)]  # fmt: skip


class GPT(nn.Module):
    """The whole model in one process: the reference the pipeline is checked against."""

    def __init__(self, shape: ModelShape, seed: int):
        super().__init__()
        self.stage = StageModule(shape, range(shape.n_layer + 2), seed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        return self.stage(idx)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy; logits (B, T, VOCAB), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
