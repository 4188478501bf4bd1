"""Chunked top-k sparsification (SparseLoCo, arXiv 2508.15706): few values, few bits, tight indices.

    a tensor, flattened, in chunks of `chunk` consecutive values (one chunk if it is smaller)
    per chunk: the k = round(density * chunk) values of largest magnitude
    values: a sign bit and (bits - 1) magnitude bits; per chunk 2^(bits-1) bf16 magnitudes,
            each the mean |value| of its share of the kept values (sorted by magnitude)
    indices: Elias-Fano per chunk: the low L = floor(log2(chunk / k)) bits of each sorted index
            as they are, the high bits in unary (k + chunk >> L bits)

At density 64/4096 with 2-bit values a chunk costs 64 x (2 + 6) + 128 + 32 bits: 84 bytes for
16 KiB of fp32, 195x fewer. Decoding gives `sign * magnitude`, exact copies of bf16 numbers:
the same bits on every machine (outer.py's rule). Encoding runs on the sender only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

Buffer = bytes | memoryview
"""Bytes, or a view into a received message (read in place)."""

__all__ = ["Kept", "SparseChunks", "TopKLayout", "decode_topk", "encode_topk", "pack_topk", "select_topk", "unpack_topk"]


@dataclass(frozen=True)
class TopKLayout:
    """How one tensor is cut into chunks and how much of each is kept."""

    numel: int
    chunk: int
    k: int

    @classmethod
    def of(cls, numel: int, *, chunk: int, density: float) -> TopKLayout:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        size = max(1, min(chunk, numel))
        return cls(numel, size, max(1, min(size, round(density * size))))

    @property
    def n_chunks(self) -> int:
        return -(-self.numel // self.chunk)

    @property
    def low_bits(self) -> int:
        return max(0, int(math.floor(math.log2(self.chunk / self.k))))

    @property
    def high_bits(self) -> int:
        """Length of one chunk's unary-coded high parts."""
        return self.k + (self.chunk >> self.low_bits) + 1


@dataclass(frozen=True)
class SparseChunks:
    """One tensor's top-k message."""

    layout: TopKLayout
    bits: int
    signs: Buffer
    """One bit per kept value, set for negative values."""
    levels: Buffer
    """(bits - 1) bits per kept value: which of its chunk's magnitudes it takes."""
    magnitudes: Buffer
    """2^(bits-1) bf16 magnitudes per chunk, ascending."""
    low: Buffer
    high: Buffer

    @property
    def nbytes(self) -> int:
        return len(self.signs) + len(self.levels) + len(self.magnitudes) + len(self.low) + len(self.high)


@dataclass(frozen=True)
class Kept:
    """What a run of consecutive chunks keeps, unpacked: per chunk its k sorted indices, each value's
    level and sign, and the chunk's levels (bf16 numbers, held as fp32)."""

    index: torch.Tensor
    """(chunks, k) int32, ascending within each chunk (widened a slice at a time: memory)."""
    levels: torch.Tensor
    """(chunks, k) uint8: which of its chunk's magnitudes each value takes."""
    negative: torch.Tensor
    """(chunks, k) bool."""
    magnitudes: torch.Tensor
    """(chunks, 2^(bits-1)) fp32, each exactly a bf16 number, ascending."""

    def values(self, first: int = 0, stop: int | None = None) -> torch.Tensor:
        """The kept values of chunks [first, stop): sign times magnitude, exact copies of bf16 numbers."""
        values = self.magnitudes[first:stop].gather(1, self.levels[first:stop].long())
        return torch.where(self.negative[first:stop], -values, values)

    def dense(self, first: int, stop: int, chunk: int) -> torch.Tensor:
        """Chunks [first, stop) of these (numbered from 0 here) as dense fp32, zeros where nothing was kept."""
        out = torch.zeros(stop - first, chunk, dtype=torch.float32)
        out.scatter_(1, self.index[first:stop].long(), self.values(first, stop))
        return out.reshape(-1)


def select_topk(x: torch.Tensor, layout: TopKLayout, bits: int) -> Kept:
    """Top-k of the consecutive chunks `x` covers (its length a multiple of the chunk, except at the end
    of the tensor, where it is padded with zeros)."""
    if bits not in (2, 3, 4):
        raise ValueError(f"bits must be 2, 3 or 4, got {bits}")
    chunks = _chunks(x.detach().reshape(-1).to(torch.float32), layout.chunk)
    index = torch.topk(chunks.abs(), layout.k, dim=1, sorted=False).indices.sort(dim=1).values
    values = chunks.gather(1, index)
    magnitudes, levels = _levels(values.abs(), 2 ** (bits - 1))
    magnitudes = magnitudes.to(torch.bfloat16).to(torch.float32)
    return Kept(index.to(torch.int32), levels.to(torch.uint8), values < 0, magnitudes)


def pack_topk(parts: Sequence[Kept], layout: TopKLayout, bits: int) -> SparseChunks:
    """The message of a tensor whose chunks, in order, `parts` kept."""
    index = torch.cat([p.index for p in parts]).numpy()
    levels = torch.cat([p.levels for p in parts]).numpy()
    negative = torch.cat([p.negative for p in parts]).numpy()
    magnitudes = torch.cat([p.magnitudes for p in parts])
    if index.shape != (layout.n_chunks, layout.k):
        raise ValueError(f"top-k parts hold {index.shape[0]} chunks, the tensor has {layout.n_chunks}")
    return SparseChunks(
        layout=layout,
        bits=bits,
        signs=np.packbits(negative.reshape(-1), bitorder="little").tobytes(),
        levels=_pack_uint(levels.reshape(-1), bits - 1),
        magnitudes=magnitudes.to(torch.bfloat16).view(torch.int16).numpy().tobytes(),
        low=_pack_uint((index & ((1 << layout.low_bits) - 1)).reshape(-1), layout.low_bits),
        high=_unary_high(index >> layout.low_bits, layout),
    )


def unpack_topk(message: SparseChunks) -> Kept:
    """The kept values of a message, checked (raises ValueError for a malformed or non-finite one)."""
    layout, k = message.layout, message.layout.k
    n_kept = layout.n_chunks * k
    index = _decode_indices(message, n_kept).reshape(layout.n_chunks, k)
    levels = _unpack_uint(message.levels, message.bits - 1, n_kept)
    n_levels = 2 ** (message.bits - 1)
    mags = np.frombuffer(message.magnitudes, dtype=np.int16)
    if mags.size != layout.n_chunks * n_levels:
        raise ValueError(f"top-k message: {mags.size} magnitudes for {layout.n_chunks} chunks")
    magnitudes = torch.from_numpy(mags.copy()).view(torch.bfloat16).to(torch.float32).reshape(-1, n_levels)
    if not bool(torch.isfinite(magnitudes).all()):
        raise ValueError("top-k message: a magnitude is NaN or Inf")
    if len(message.signs) != -(-n_kept // 8):
        raise ValueError(f"top-k message: {len(message.signs)} sign bytes for {n_kept} values")
    negative = np.unpackbits(np.frombuffer(message.signs, dtype=np.uint8), count=n_kept, bitorder="little")
    return Kept(
        torch.from_numpy(index),
        torch.from_numpy(levels.astype(np.uint8).reshape(layout.n_chunks, k)),
        torch.from_numpy(negative.astype(bool)).reshape(layout.n_chunks, k),
        magnitudes,
    )


def encode_topk(x: torch.Tensor, *, chunk: int = 4096, density: float = 1 / 64, bits: int = 2) -> SparseChunks:
    """The top-k message of `x`: in each chunk its k largest-magnitude values, quantized."""
    layout = TopKLayout.of(x.numel(), chunk=chunk, density=density)
    return pack_topk([select_topk(x, layout, bits)], layout, bits)


def decode_topk(message: SparseChunks, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """The dense fp32 tensor a message stands for (zeros where nothing was kept)."""
    layout = message.layout
    dense = unpack_topk(message).dense(0, layout.n_chunks, layout.chunk)
    return dense[: layout.numel].reshape(shape)


def _chunks(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    if flat.numel() % chunk == 0:
        return flat.view(-1, chunk)
    padded = torch.zeros(-(-flat.numel() // chunk) * chunk, dtype=torch.float32)
    padded[: flat.numel()] = flat
    return padded.view(-1, chunk)


def _levels(magnitude: torch.Tensor, n_levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk, split the kept values by magnitude rank into `n_levels` equal groups; each group's
    level is its mean magnitude. Returns (levels per chunk ascending, level index per value)."""
    k = magnitude.shape[1]
    order = magnitude.argsort(dim=1)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(k).expand_as(order).contiguous())
    group = (rank * n_levels) // k  # 0 .. n_levels-1, groups of equal size (within one)
    sums = torch.zeros(magnitude.shape[0], n_levels, dtype=torch.float64).scatter_add_(1, group, magnitude.double())
    counts = torch.zeros(magnitude.shape[0], n_levels, dtype=torch.float64).scatter_add_(
        1, group, torch.ones_like(magnitude, dtype=torch.float64)
    )
    means = (sums / counts.clamp_min(1)).to(torch.float32)
    # an empty group (k < n_levels) takes its neighbour's level, keeping the levels ascending
    means = torch.cummax(means, dim=1).values
    return means, group


def _unary_high(high: np.ndarray, layout: TopKLayout) -> bytes:
    """Elias-Fano high parts: in each chunk's bit field, bit high[i] + i is set for its i-th index."""
    n_chunks, k = high.shape
    field = np.zeros((n_chunks, layout.high_bits), dtype=np.uint8)
    field[np.arange(n_chunks)[:, None], high + np.arange(k)[None, :]] = 1
    return np.packbits(field.reshape(-1), bitorder="little").tobytes()


def _decode_indices(message: SparseChunks, n_kept: int) -> np.ndarray:
    layout = message.layout
    field_bits = layout.n_chunks * layout.high_bits
    if len(message.high) != -(-field_bits // 8):
        raise ValueError(f"top-k message: {len(message.high)} index bytes for {layout.n_chunks} chunks")
    field = np.unpackbits(np.frombuffer(message.high, dtype=np.uint8), count=field_bits, bitorder="little")
    set_bits = np.flatnonzero(field)  # in order: chunk by chunk, ascending within each
    if set_bits.size != n_kept:
        raise ValueError("top-k message: malformed index field")
    rows, positions = np.divmod(set_bits, layout.high_bits)
    if n_kept and np.any(rows.reshape(layout.n_chunks, layout.k) != np.arange(layout.n_chunks)[:, None]):
        raise ValueError("top-k message: malformed index field")  # not k set bits in every chunk's field
    # indices < chunk (4096 by default): int32 throughout, as Kept holds them
    high = positions.astype(np.int32).reshape(layout.n_chunks, layout.k) - np.arange(layout.k, dtype=np.int32)[None, :]
    low = _unpack_uint(message.low, layout.low_bits, n_kept).astype(np.int32, copy=False).reshape(layout.n_chunks, layout.k)
    index = (high << layout.low_bits) | low
    if np.any(index >= layout.chunk):
        raise ValueError("top-k message: index outside its chunk")
    if layout.k > 1 and np.any(index[:, 1:] <= index[:, :-1]):  # a repeated index would decode differently by scatter order
        raise ValueError("top-k message: indices not strictly ascending within a chunk")
    return index


def _pack_uint(values: np.ndarray, bits: int) -> bytes:
    """Unsigned integers of `bits` bits each, packed tightly (little-endian bit order)."""
    if bits == 0:
        return b""
    planes = np.empty((values.size, bits), dtype=np.uint8)  # one byte per bit: 1/8 of an int64 plane
    for b in range(bits):
        planes[:, b] = (values >> b) & 1
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def _unpack_uint(blob: bytes, bits: int, n: int) -> np.ndarray:
    if bits == 0:
        return np.zeros(n, dtype=np.int64)
    if len(blob) != -(-n * bits // 8):
        raise ValueError(f"top-k message: {len(blob)} bytes for {n} values of {bits} bits")
    if 2 <= bits <= 8:
        return _unpack_narrow(blob, bits, n)
    planes = np.unpackbits(np.frombuffer(blob, dtype=np.uint8), count=n * bits, bitorder="little").reshape(n, bits)
    out = np.zeros(n, dtype=np.int64)
    for b in range(bits):
        out |= planes[:, b].astype(np.int64) << b
    return out


def _unpack_narrow(blob: bytes, bits: int, n: int) -> np.ndarray:
    """`_unpack_uint` for 2..8 bits, a group of lcm(bits, 8) bits at a time: its bytes as one little-endian word,
    each value a shift and a mask of it (not a byte per bit: 6-bit top-k offsets decode 6x faster)."""
    group = math.lcm(bits, 8)
    size, per = group // 8, group // bits  # bytes and values of a group
    groups = -(-n // per)
    raw = np.zeros(groups * size, dtype=np.uint8)
    raw[: len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    raw = raw.reshape(groups, size).astype(np.uint64)
    word = raw[:, 0].copy()
    for j in range(1, size):
        word |= raw[:, j] << np.uint64(8 * j)
    out = np.empty((groups, per), dtype=np.int64)
    mask = np.uint64((1 << bits) - 1)
    for i in range(per):
        out[:, i] = (word >> np.uint64(i * bits)) & mask
    return out.reshape(-1)[:n]
