"""Low-rank approximation of pseudo-gradient matrices (PowerSGD, arXiv 1905.13727), decoded exactly.

One power iteration per round, spread over rounds by warm-starting Q (DESIGN.md, "Compression"):

    P_i = M_i Q                  each peer, with the Q every peer holds (shared state)
    P   = mean_i P_i             phase 1: averaged in the stage group
    B   = basis(P)               an orthonormal basis of P's columns (exact, below)
    Q_i = M_i^T B                each peer
    Q'  = mean_i Q_i             phase 2: averaged in the stage group
    M~  = B Q'^T                 the decoded average; Q' is the next round's Q

P and Q' are the same bits on every member (exact means of decoded messages), and `basis`
and `reconstruct` turn them into B and M~ with the same bits on every machine, although an
orthonormalization and a matrix product are made of reductions (outer.py's rule 2):

- Each column j of P is rounded to integers P_int = round(P / s_j) with |P_int| < 2^b and s_j
  a power of two (so scaling by it is exact), b small enough that the Gram matrix
  P_int^T P_int is a sum of integers below 2^53: exact in float64, in any order, with or
  without fused multiply-add. So a BLAS matmul computes it exactly; G = S P_int^T P_int S.
- G = L L^T (Cholesky) runs in numpy float64 one separately rounded operation at a time,
  in a fixed order (r x r: cheap). B = P_int L^-T has orthonormal columns.
- M~ = B Q'^T = P_int W with W = S L^-T Q'^T, solved row by row with elementwise operations;
  W is rounded to integers the same way, and P_int W_int is again an exact integer matmul,
  scaled once by s_W.

The fixed point limits the precision of B to about 2^-b relative to each column of P
divided by P's condition number: ~1e-4 at b = 22 for condition numbers near 1e3, far below
what int4 or int8 factors on the wire leave.

A column of P that is (numerically) a combination of earlier ones gets no basis vector: its
row of W is zero. The rank of each matrix adapts (`adapt_rank`) to the share of the energy
the approximation captures, decided from the numbers in the group's messages so that every
member decides alike: the lower median of the members' shares (`group_energy`), and for the
factors' width the rank most messages used (`group_rank`, `fit_rank`). A phase-2 message names
the phase-1 messages its basis came from (`basis_digest`).
"""

from __future__ import annotations

import collections
import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..model import portable_normal
from .payload import rows_per_slice

__all__ = [
    "Basis", "adapt_rank", "agreed_ranks", "basis", "basis_digest", "energy", "factorable", "fit_rank", "group_energy", "group_rank", "initial_q", "local_basis",
    "reconstruct",
]  # fmt: skip

_EXACT_BITS = 52  # integer sums below 2^53 are exact in float64
_ROWS_VALUES = 1 << 20  # reconstruct this many values at a time
_DEAD_PIVOT = 1e-12  # a pivot below this share of its column's squared norm: the column adds nothing new


@dataclass(frozen=True)
class Basis:
    """An orthonormal basis B = p_int @ inv(L)^T of an averaged P, in exact integer form."""

    p_int: torch.Tensor
    """P rounded to integers column by column (float64 holding integers), shape (n, r)."""
    scales: np.ndarray
    """The power of two of each column: P ~ p_int * scales."""
    chol: np.ndarray
    """L, lower triangular (r, r), float64; a zero column marks a column of P with nothing new."""

    @property
    def rank(self) -> int:
        return self.p_int.shape[1]


def initial_q(run_id: str, round: int, name: str, cols: int, rank: int) -> torch.Tensor:
    """The Q a tensor starts from when no averaged Q is known: seeded by run, round and name, the same
    bits on every machine (portable_normal)."""
    seed = int.from_bytes(hashlib.sha256(f"{run_id}/{round}/{name}".encode()).digest()[:8], "little")
    return portable_normal((cols, rank), np.random.default_rng(seed), std=1.0)


def _int_bits(length: int) -> int:
    """Bits per integer so that a sum of `length` products of two such integers stays below 2^53."""
    return max(1, (_EXACT_BITS - max(1, math.ceil(math.log2(max(length, 2))))) // 2)


def _to_int(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, float]:
    """x / s rounded to integers below 2^bits in magnitude, and s (0 for an all-zero x)."""
    x64 = x.to(torch.float64)
    absmax = float(x64.abs().max()) if x64.numel() else 0.0  # a max is exact in any order
    if absmax == 0.0 or not math.isfinite(absmax):
        return torch.zeros_like(x64), 0.0
    scale = absmax / float(2**bits - 1)
    return torch.round(x64 / scale), scale


def _columns_to_int(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, np.ndarray]:
    """Each column of x as integers below 2^bits in magnitude times a power of two (exact scaling)."""
    x64 = x.to(torch.float64)
    absmax = x64.abs().amax(dim=0).numpy() if x64.shape[0] else np.zeros(x64.shape[1])  # exact in any order
    exponents = np.array([math.frexp(a)[1] if a > 0 and math.isfinite(a) else 0 for a in absmax])
    scales = np.ldexp(1.0, exponents - bits)  # absmax / scale < 2^bits
    scales[~(absmax > 0)] = 1.0
    p_int = torch.round(x64 * torch.from_numpy(1.0 / scales))  # times a power of two: exact before rounding
    p_int[:, torch.from_numpy(~np.isfinite(absmax))] = 0.0
    return p_int, scales


def basis(p: torch.Tensor) -> Basis:
    """An orthonormal basis of the columns of `p` (n, r), computed exactly (module docstring)."""
    n, r = p.shape
    p_int, scales = _columns_to_int(p, _int_bits(n))
    gram = (p_int.T @ p_int).numpy() * np.outer(scales, scales)  # exact: integer sums below 2^53, powers of two
    return Basis(p_int, scales, _cholesky(gram))


def _cholesky(gram: np.ndarray) -> np.ndarray:
    """L with L L^T = gram, one rounded float64 operation at a time in a fixed order."""
    r = gram.shape[0]
    chol = np.zeros((r, r), dtype=np.float64)
    for j in range(r):
        column = gram[j:, j].copy()
        for k in range(j):
            if chol[j, k] != 0.0:
                column -= chol[j:, k] * chol[j, k]
        pivot = column[0]
        if not pivot > _DEAD_PIVOT * gram[j, j] or pivot <= 0.0:
            continue  # dependent (or zero) column: no basis vector
        diag = math.sqrt(pivot)
        chol[j, j] = diag
        chol[j + 1 :, j] = column[1:] / diag
    return chol


def local_basis(b: Basis) -> torch.Tensor:
    """B as fp32 (n, r), for this peer's own Q_i = M_i^T B: any rounding will do there."""
    inv = np.zeros_like(b.chol)
    alive = np.diag(b.chol) > 0
    if alive.any():
        sub = b.chol[np.ix_(alive, alive)]
        inv[np.ix_(alive, alive)] = np.linalg.inv(sub)
    return ((b.p_int * torch.from_numpy(b.scales)) @ torch.from_numpy(inv.T)).to(torch.float32)


def reconstruct(b: Basis, q: torch.Tensor) -> torch.Tensor:
    """M~ = B Q^T as fp32 (n, m) from the basis and the averaged Q (m, r): the same bits everywhere."""
    qt = q.to(torch.float64).T.numpy()  # (r, m)
    r = b.rank
    w = np.zeros_like(qt)
    for j in range(r - 1, -1, -1):  # back substitution: L^T W = Q^T, one row at a time
        if b.chol[j, j] == 0.0:
            continue
        row = qt[j].copy()
        for k in range(j + 1, r):
            if b.chol[k, j] != 0.0:
                row -= w[k] * b.chol[k, j]
        w[j] = row / b.chol[j, j]
    w *= b.scales[:, None]  # P = p_int S: fold S into W (powers of two: exact)
    w_bits = _EXACT_BITS - _int_bits(b.p_int.shape[0]) - max(1, math.ceil(math.log2(max(r, 2))))
    w_int, w_scale = _to_int(torch.from_numpy(w), w_bits)
    out = torch.empty(b.p_int.shape[0], w_int.shape[1], dtype=torch.float32)
    rows = max(1, _ROWS_VALUES // max(w_int.shape[1], 1))  # a few MB of float64 at a time
    for lo in range(0, out.shape[0], rows):
        product = b.p_int[lo : lo + rows] @ w_int  # exact: integer sums below 2^53
        out[lo : lo + rows] = product.mul_(w_scale)
    return out


def adapt_rank(rank: int, energy: float, *, target: float, low: int, high: int) -> int:
    """The next round's rank: grow by a quarter while the captured energy is below `target`, shrink by
    an eighth while it is well above it (above target + (1 - target) / 2), within [low, high]."""
    if energy < target:
        return min(high, rank + max(1, rank // 4))
    if energy > target + (1.0 - target) / 2:
        return max(low, rank - max(1, rank // 8))
    return rank


def group_energy(energies: Sequence[tuple[float, float]]) -> float:
    """The share of a matrix's energy the group's basis kept: the lower median of the members' shares
    (kept / total, at most 1), so that no member's own numbers steer the group's ranks. (The share of the
    summed energies let one member claiming a total of 1e30 drive every member's rank to its cap.) The
    numbers travelled in the messages: every member computes the same share."""
    shares = sorted(min(kept / total, 1.0) if total > 0 else 1.0 for total, kept in energies)
    return shares[(len(shares) - 1) // 2] if shares else 1.0


def basis_digest(gathered: Sequence[bytes | None], used: Sequence[int]) -> bytes:
    """Names the phase-1 messages a low-rank basis is computed from: sha256 over each averaged message's index
    in the group and its own sha256. Members that averaged the same messages compute the same basis (bit for
    bit: outer.py's rule), so equal digests mean factors in one basis."""
    digest = hashlib.sha256(b"dilocox low-rank basis v1")
    for index in used:
        blob = gathered[index]
        assert blob is not None, "an averaged message was received"
        digest.update(struct.pack("<I", index) + hashlib.sha256(blob).digest())
    return digest.digest()


def group_rank(ranks: Sequence[int]) -> int | None:
    """The rank most of the group's messages use for a matrix (ties: the larger), None if none."""
    counts = collections.Counter(ranks)
    if not counts:
        return None
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


def agreed_ranks(tickets: Sequence[Sequence[int]]) -> list[int]:
    """The group's rank of each factored matrix from its members' tickets (each a list of ranks, empty: none): per
    matrix the rank most tickets name, ties to the larger, among the tickets of the length most have. Every member
    reads the same tickets, so every member agrees (the compressed butterfly needs one layout)."""
    lengths = collections.Counter(len(t) for t in tickets if t)
    if not lengths:
        return []
    width = max(lengths.items(), key=lambda kv: (kv[1], kv[0]))[0]
    return [group_rank([t[j] for t in tickets if len(t) == width]) or 1 for j in range(width)]


def fit_rank(factor: torch.Tensor, rank: int) -> torch.Tensor:
    """A factor (rows, r) cut or zero-padded to `rank` columns (a member that used another rank)."""
    if factor.shape[1] == rank:
        return factor
    if factor.shape[1] > rank:
        return factor[:, :rank]
    return torch.cat([factor, torch.zeros(factor.shape[0], rank - factor.shape[1])], dim=1)


def energy(matrix: torch.Tensor) -> float:
    """Sum of squares in float64, a slice of rows at a time (this peer's own number: any rounding will do)."""
    return math.fsum(float(torch.sum(rows.double() ** 2)) for rows in matrix.split(rows_per_slice(matrix)))


def factorable(shape: torch.Size, rank_min: int) -> bool:
    """A matrix worth factoring: its factors at the lowest rank (`rank_min`) are well below its size."""
    return len(shape) == 2 and min(shape) > 1 and rank_min * (shape[0] + shape[1]) * 4 <= shape[0] * shape[1]
