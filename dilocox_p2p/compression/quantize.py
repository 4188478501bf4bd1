"""Blockwise quantization (int8, int4, fp4 E3M0) and fp16: dense codecs for pseudo-gradients and factors.

    blocks of `block` consecutive values; per block a bf16 scale s >= absmax / qmax
    code = round(x / s), clamped to [-qmax, qmax]        (qmax: 127 for int8, 7 for int4)
    decode: x~ = code * s                                 (one rounded multiply: the same bits everywhere)

Encoding runs on the sender only, so its rounding may differ between machines; the decode
is one IEEE-754 multiply of exactly representable numbers (an integer code and a bf16
scale widened to fp32), so every peer decodes a message to the same bits (outer.py's rule).
The scale is rounded *up* to bf16, so no code is ever clamped and the error of every value
is at most s / 2 (`error_bound`), up to a scale of SCALE_MAX (2^120): a block beyond it (values
near fp32's largest) is clamped rather than sent as Inf, and error feedback keeps the rest.

int4 codes travel two to a byte; scales travel as bf16 (2 bytes per block). hivemind's own
8-bit codecs are not used: numpy 2 silently breaks them (notes/hivemind-facts.md, trap 1).

fp4 (E3M0, Streaming DiLoCo's outer-gradient format): a sign bit and a 3-bit exponent, no
mantissa. Per block a bf16 scale s >= absmax; code e = 0 stands for 0, e = 1..7 for
+-s * 2^(e - 7) (magnitudes s/64 ... s), the nearest to each value. Decoding multiplies an
exact power of two by the widened scale: one rounded multiply, the same bits everywhere.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["FP4_MAGNITUDES", "Quantized", "dequantize", "dequantize_fp4", "error_bound", "quantize", "quantize_fp4"]

Bits = Literal[4, 8]
_QMAX = {8: 127, 4: 7}
_BF16_UP = 1.0 + 2.0**-7  # one bf16 ulp (relative): rounding s * (1 + 2^-7) to nearest never goes below s
SCALE_MAX = 2.0**120
"""The largest scale (exact in bf16): a receiver requires scale * 128 finite in fp32. A block of values
above qmax * SCALE_MAX is clamped (the rest stays in error feedback), never encoded as Inf."""


@dataclass(frozen=True)
class Quantized:
    """A tensor quantized blockwise: what travels, and what is needed to decode it."""

    codes: bytes
    """int8 codes, or int4 codes two to a byte (low nibble first), each stored as code + 8."""
    scales: bytes
    """One bf16 scale per block."""
    shape: tuple[int, ...]
    bits: int
    block: int

    @property
    def nbytes(self) -> int:
        return len(self.codes) + len(self.scales)


def quantize(x: torch.Tensor, *, bits: Bits = 8, block: int = 64) -> Quantized:
    """Quantize `x` (any shape, float) blockwise to `bits`-bit integers with one bf16 scale per block."""
    if bits not in _QMAX:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    qmax = _QMAX[bits]
    flat, blocks = _blocks(x, block)
    n = flat.numel()
    absmax = blocks.abs().amax(dim=1)  # a max is exact in any order
    scales = (absmax / qmax * _BF16_UP).clamp_(max=SCALE_MAX).to(torch.bfloat16)
    wide = scales.to(torch.float32)
    safe = torch.where(wide > 0, wide, torch.ones_like(wide))
    codes = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)[:n]
    return Quantized(_pack(codes, bits), scales.view(torch.int16).numpy().tobytes(), tuple(x.shape), bits, block)


FP4_MAGNITUDES = torch.tensor([0.0] + [2.0 ** (e - 7) for e in range(1, 8)], dtype=torch.float32)
"""|value| / scale of the E3M0 codes 0..7 (the sign is bit 3 of a code)."""
_FP4_VALUES = torch.cat([FP4_MAGNITUDES, -FP4_MAGNITUDES])  # a code's value / scale, by code 0..15
_FP4_MIDPOINTS = (FP4_MAGNITUDES[:-1] + FP4_MAGNITUDES[1:]) / 2  # exact: 2^-7, then 1.5 * 2^(e-7)


def quantize_fp4(x: torch.Tensor, *, block: int = 64) -> Quantized:
    """Quantize `x` blockwise to E3M0 fp4 codes (sign << 3 | exponent) with one bf16 scale per block."""
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    flat, blocks = _blocks(x, block)
    n = flat.numel()
    scales = (blocks.abs().amax(dim=1) * _BF16_UP).clamp_(max=SCALE_MAX).to(torch.bfloat16)  # >= absmax up to SCALE_MAX
    wide = scales.to(torch.float32)
    ratio = (blocks.abs() / torch.where(wide > 0, wide, torch.ones_like(wide))[:, None]).reshape(-1)[:n]
    exponent = torch.bucketize(ratio, _FP4_MIDPOINTS)  # the nearest magnitude (a tie: the smaller)
    codes = exponent + 8 * ((flat < 0) & (exponent > 0))
    return Quantized(_pack_nibbles(codes.to(torch.uint8).numpy()), scales.view(torch.int16).numpy().tobytes(),
                     tuple(x.shape), 4, block)  # fmt: skip


def dequantize_fp4(q: Quantized) -> torch.Tensor:
    """The fp32 tensor fp4 codes stand for: +-2^(e-7) * scale, one rounded multiply per value."""
    n = int(np.prod(q.shape, dtype=np.int64))
    raw = read_only_tensor(q.codes, torch.uint8)
    if raw.numel() != -(-n // 2):
        raise ValueError(f"fp4 codes: {raw.numel()} bytes for {n} values (expected {-(-n // 2)})")
    codes = _nibbles(raw, n).to(torch.int64)
    return _times_scales(_FP4_VALUES[codes], q.scales, q.block).reshape(q.shape)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 tensor `q` stands for: code * scale, one rounded multiply per value."""
    n = int(np.prod(q.shape, dtype=np.int64))
    return _times_scales(_unpack(q.codes, q.bits, n), q.scales, q.block).reshape(q.shape)


def _times_scales(codes: torch.Tensor, scales: object, block: int) -> torch.Tensor:
    """codes (one value each, any real dtype) times their block's bf16 scale, as fp32: the value converted exactly,
    then one rounded fp32 multiply, a block at a time against its scale broadcast (no per-value copy of the scales:
    the same bits as multiplying by a repeated scale)."""
    n = codes.numel()
    wide = read_only_tensor(scales, torch.int16).view(torch.bfloat16).to(torch.float32)
    if wide.numel() != -(-n // block):
        raise ValueError(f"{wide.numel()} scales for {n} values in blocks of {block}")
    out = torch.empty(n, dtype=torch.float32)
    whole = n // block * block
    values = codes.to(torch.float32)  # exact (|code| < 2^24); a mixed-type multiply is 2.5x slower
    torch.mul(values[:whole].view(-1, block), wide[: whole // block, None], out=out[:whole].view(-1, block))
    if whole < n:
        torch.mul(values[whole:], wide[-1], out=out[whole:])
    return out


def read_only_tensor(blob: object, dtype: torch.dtype) -> torch.Tensor:
    """A read-only buffer (bytes, memoryview) as a tensor of `dtype`, without copying it (never written)."""
    view = memoryview(blob).cast("B")  # type: ignore[arg-type]
    if not len(view):
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():  # torch warns of a read-only buffer; these tensors are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype)


def error_bound(x: torch.Tensor, *, bits: Bits = 8, block: int = 64) -> torch.Tensor:
    """The largest error `quantize` may make on each value of `x`: half its block's scale."""
    q = quantize(x, bits=bits, block=block)
    n = x.numel()
    scales = torch.from_numpy(np.frombuffer(q.scales, dtype=np.int16).copy()).view(torch.bfloat16)
    return (scales.to(torch.float32) / 2).repeat_interleave(block)[:n].reshape(x.shape)


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` flattened to fp32, and zero-padded to whole blocks as a (blocks, block) view."""
    flat = x.detach().reshape(-1).to(torch.float32)
    padded = torch.zeros(-(-flat.numel() // block) * block, dtype=torch.float32)
    padded[: flat.numel()] = flat
    return flat, padded.view(-1, block)


def _pack(codes: torch.Tensor, bits: int) -> bytes:
    if bits == 8:
        return codes.numpy().tobytes()
    return _pack_nibbles((codes.to(torch.int16) + 8).to(torch.uint8).numpy())


def _pack_nibbles(nibbles: np.ndarray) -> bytes:
    """Values 0..15 two to a byte, low nibble first (an odd count padded with an 8)."""
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(8))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


def _unpack(blob: bytes, bits: int, n: int) -> torch.Tensor:
    """The `n` codes of a blob as integers (int8: the bytes themselves, not copied; int4: two a byte, low first)."""
    raw = read_only_tensor(blob, torch.uint8 if bits == 4 else torch.int8)
    expected = n if bits == 8 else -(-n // 2)
    if raw.numel() != expected:
        raise ValueError(f"{bits}-bit codes: {raw.numel()} bytes for {n} values (expected {expected})")
    if bits == 8:
        return raw
    return _nibbles(raw, n).to(torch.int8) - 8


def _nibbles(raw: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` 4-bit values of uint8 bytes, two a byte, low nibble first."""
    return torch.stack([raw & 0x0F, raw >> 4], dim=1).reshape(-1)[:n]
