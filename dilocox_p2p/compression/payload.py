"""One message's payload: a stage's pieces laid end to end, encoded and decoded a slice at a time.

    layout = FlatLayout(shapes, pad)                 # pieces end to end, each on a multiple of pad
    sections, kept = encode_payload(cfg, pieces, pad=pad, out=message.payload, feedback=buffers)
    blob = frame(message, sections)                  # header, then the raw sections
    message, sections = unframe(blob)                # on the receiver: views into blob, no copy
    reader = PayloadReader.of(message.payload, sections, layout.numel)  # checks it whole
    reader.read(lo, hi)                               # fp32 values [lo, hi) of the flat vector

No whole flat copy of a stage is ever made: encoding reads `SLICE` values of the pieces at a
time, encodes them, and subtracts what they decode to from the error-feedback buffers in
place; the mean of a group's messages (`streamed_mean`) is built slice by slice into the
output tensors. So the codec's memory beyond the messages themselves is the output and a few
slices of temporaries, whatever the stage's size (the goal: at most 3 extra fp32 copies of a
stage's shard, error-feedback buffer included).

A message travels framed: a 4-byte length, its protobuf header (compression.proto), then the
payload's raw sections (fp16 values; int8 codes and scales; top-k signs, levels, magnitudes
and index bits). A receiver reads the sections in place (memoryviews of the received bytes),
so a message costs its own size once, not once more for every protobuf field read out of it.

Slices start on a quantization block (int4: on two, so that a byte never holds two slices'
codes) or a top-k chunk, so encoding slice by slice gives exactly the bytes of encoding the
whole vector at once, and decoding a slice is one block's or one chunk's business.
"""

from __future__ import annotations

import bisect
import math
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from google.protobuf.message import DecodeError

from ..average import all_finite, fixed_order_sum, ordered_mean
from ..config import TOPK_MAX_CHUNK, CompressionConfig
from ..proto_gen import compression_pb2 as pb
from .quantize import Quantized, dequantize, dequantize_fp4, quantize, quantize_fp4, read_only_tensor
from .topk import Kept, SparseChunks, TopKLayout, pack_topk, select_topk, unpack_topk

__all__ = [
    "FlatLayout", "PayloadReader", "ScaledReader", "encode_payload", "encoding_of", "frame", "rows_per_slice",
    "streamed_mean", "unframe",
]  # fmt: skip

SLICE = 1 << 20
"""Values encoded or decoded at a time (4 MB of fp32): temporaries stay a few slices big."""
MAX_HEADER_BYTES = 1 << 20
"""A header is a few numbers per factored matrix; anything longer is not an honest message."""
_LENGTH = struct.Struct("<I")
FP16_MAX = float(torch.finfo(torch.float16).max)
"""The largest fp16 value (65504): an fp16 message clamps to it (the rest stays in error feedback), never Inf."""

Section = Sequence[object]
"""One raw section of a payload, as buffers (bytes, numpy arrays) laid end to end."""


class FlatLayout:
    """Tensors of given shapes laid end to end as one flat vector, each starting on a multiple of
    `pad` (zeros between): the vector a message's payload encodes."""

    def __init__(self, shapes: Sequence[torch.Size], pad: int):
        self.shapes = [torch.Size(s) for s in shapes]
        self.offsets: list[int] = []
        offset = 0
        for shape in self.shapes:
            self.offsets.append(offset)
            offset += -(-shape.numel() // pad) * pad
        self.numel = offset
        self._ends = [o + s.numel() for o, s in zip(self.offsets, self.shapes)]  # ascending: `overlaps` bisects them

    def slices(self, step: int) -> Iterator[tuple[int, int]]:
        for lo in range(0, self.numel, step):
            yield lo, min(lo + step, self.numel)

    def overlaps(self, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """(piece, start, end within the piece's flat view, where that starts within [lo, hi))."""
        for index in range(bisect.bisect_right(self._ends, lo), len(self.offsets)):  # the first piece ending past lo
            offset = self.offsets[index]
            if offset >= hi:
                return
            a, b = max(lo, offset), min(hi, self._ends[index])
            if a < b:
                yield index, a - offset, b - offset, a - lo

    def read(self, pieces: Sequence[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Values [lo, hi) of the flat vector, as a new fp32 tensor (zeros in the padding, the only values not
        copied: no pass of zeros over the whole slice first)."""
        out = torch.empty(hi - lo, dtype=torch.float32)
        filled = 0
        for index, a, b, at in self.overlaps(lo, hi):
            if at > filled:
                out[filled:at].zero_()
            out[at : at + b - a] = pieces[index].reshape(-1)[a:b]
            filled = at + b - a
        if filled < hi - lo:
            out[filled:].zero_()
        return out

    def write(self, pieces: Sequence[torch.Tensor], lo: int, hi: int, values: torch.Tensor) -> None:
        """pieces[lo:hi] <- values (contiguous pieces)."""
        for index, a, b, at in self.overlaps(lo, hi):
            pieces[index].view(-1)[a:b] = values[at : at + b - a]

    def subtract(self, pieces: Sequence[torch.Tensor | None], lo: int, hi: int, values: torch.Tensor) -> None:
        """pieces[lo:hi] -= values, for the pieces given (contiguous; None: left alone)."""
        for index, a, b, at in self.overlaps(lo, hi):
            piece = pieces[index]
            if piece is not None:
                piece.view(-1)[a:b].sub_(values[at : at + b - a])


def rows_per_slice(matrix: torch.Tensor, values: int = SLICE) -> int:
    """Rows of `matrix` worth a slice of `values` (SLICE as this module was loaded): the unit of work on whole
    matrices, a memory bound apart from the encoding (a low-rank energy's last bit follows it)."""
    return max(1, values // max(matrix.shape[1], 1))


def slice_step(cfg: CompressionConfig, numel: int) -> int:
    """Slice length for `cfg.kind` over a vector of `numel` values (aligned: module docstring)."""
    if cfg.kind == "topk":
        unit = TopKLayout.of(max(numel, 1), chunk=cfg.topk_chunk, density=cfg.topk_density).chunk
    elif cfg.kind in ("int8", "lowrank", "fp4"):
        unit = 2 * cfg.block
    else:
        unit = 1
    return unit * max(1, SLICE // unit)


def encode_payload(
    cfg: CompressionConfig,
    pieces: Sequence[torch.Tensor],
    *,
    pad: int,
    out: pb.EncodedTensor,
    feedback: Sequence[torch.Tensor | None] | None = None,
    keep: bool = False,
    whole: int | None = None,
) -> tuple[list[Section], list[torch.Tensor] | None]:
    """Encode `pieces` as one payload: its description goes into `out`, its bytes come back as raw
    sections (for `frame`). What they decode to is subtracted from `feedback` (per piece a buffer, or
    None) and, if `keep`, returned as tensors shaped like the pieces. `whole`: the length of the message
    these pieces are a span of (a reduced part of the compressed butterfly), which sets top-k's chunks."""
    layout = FlatLayout([p.shape for p in pieces], pad)
    kept = [torch.empty(p.shape, dtype=torch.float32) for p in pieces] if keep else None
    encoder = _Encoder(cfg, layout.numel, whole=whole)
    for lo, hi in layout.slices(slice_step(cfg, layout.numel)):
        decoded = encoder.add(layout.read(pieces, lo, hi))
        if feedback is not None:
            layout.subtract(feedback, lo, hi, decoded)
        if kept is not None:
            layout.write(kept, lo, hi, decoded)
    return encoder.finish(out), kept


def frame(message: pb.CompressedMessage, sections: Sequence[Section]) -> bytes:
    """The bytes of a message: its header's length, the header (which records the sections' lengths),
    then the sections. The payload is copied once, into the result."""
    buffers = [[memoryview(b).cast("B") for b in section] for section in sections]
    message.payload.sections[:] = [sum(b.nbytes for b in section) for section in buffers]
    head = message.SerializeToString()
    return b"".join([_LENGTH.pack(len(head)), head, *(b for section in buffers for b in section)])


def unframe(blob: bytes) -> tuple[pb.CompressedMessage, list[memoryview]]:
    """The header of a framed message and views of its raw sections (into `blob`: nothing is copied).
    Raises ValueError for a message that is not framed as `frame` makes them."""
    if len(blob) < _LENGTH.size:
        raise ValueError(f"{len(blob)} bytes: shorter than a header length")
    (n,) = _LENGTH.unpack_from(blob)
    if n > min(MAX_HEADER_BYTES, len(blob) - _LENGTH.size):
        raise ValueError(f"a header of {n} bytes in a message of {len(blob)}")
    message = pb.CompressedMessage()
    try:
        message.ParseFromString(blob[_LENGTH.size : _LENGTH.size + n])
    except DecodeError as e:
        raise ValueError(f"a malformed header ({e})") from None
    view, offset = memoryview(blob), _LENGTH.size + n
    lengths = list(message.payload.sections)
    if any(length < 0 for length in lengths) or offset + sum(lengths) != len(blob):
        raise ValueError(f"sections of {lengths} bytes after a {n}-byte header in a message of {len(blob)}")
    sections = []
    for length in lengths:
        sections.append(view[offset : offset + length])
        offset += length
    return message, sections


def encoding_of(cfg: CompressionConfig, numel: int, *, whole: int | None = None) -> pb.EncodedTensor:
    """The description (no section lengths) of every payload of `numel` values under `cfg`: what the
    encoder writes, and what a receiver requires (a payload of another encoding is not this run's).
    `whole`: the length of the message a part of `numel` values was cut from (its top-k chunks are the
    message's, the last one cut short)."""
    out = pb.EncodedTensor(shape=[numel])
    if cfg.kind == "fp16":
        out.fp16.SetInParent()
    elif cfg.kind == "topk":
        layout = _topk_layout(cfg, numel, whole)
        out.sparse.CopyFrom(pb.SparseTensor(chunk=layout.chunk, k=layout.k, bits=cfg.topk_bits))
    elif cfg.kind == "fp4":
        out.fp4.CopyFrom(pb.Fp4Tensor(block=cfg.block))
    else:
        bits = cfg.factor_bits if cfg.kind == "lowrank" else 8
        out.quantized.CopyFrom(pb.QuantizedTensor(bits=bits, block=cfg.block))
    return out


def _topk_layout(cfg: CompressionConfig, numel: int, whole: int | None) -> TopKLayout:
    """Top-k's chunks of `numel` values: those of a message of `whole` values (default: `numel`) that they are
    a span of, starting on a chunk."""
    of_whole = TopKLayout.of(max(numel if whole is None else whole, 1), chunk=cfg.topk_chunk, density=cfg.topk_density)
    return TopKLayout(numel, of_whole.chunk, of_whole.k)


class _Encoder:
    """Encodes consecutive slices of one vector; `finish` gives the payload of them all."""

    def __init__(self, cfg: CompressionConfig, numel: int, *, whole: int | None = None):
        self.cfg, self.numel, self.whole = cfg, numel, whole
        self.bits = cfg.factor_bits if cfg.kind == "lowrank" else 8
        self.topk = _topk_layout(cfg, numel, whole)
        self.parts: list = []
        self.scales: list[bytes] = []
        self.half = np.empty(numel if cfg.kind == "fp16" else 0, dtype=np.float16)
        self.filled = 0

    def add(self, x: torch.Tensor) -> torch.Tensor:
        """Encode the next slice; returns what it decodes to."""
        kind = self.cfg.kind
        if kind == "fp16":
            half = x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)  # beyond: Inf, refused by every member
            self.half[self.filled : self.filled + half.numel()] = half.numpy()
            self.filled += half.numel()
            return half.to(torch.float32)
        if kind == "topk":
            kept = select_topk(x, self.topk, self.cfg.topk_bits)
            self.parts.append(kept)
            return kept.dense(0, kept.index.shape[0], self.topk.chunk)[: x.numel()]
        if kind == "fp4":
            q = quantize_fp4(x, block=self.cfg.block)
            self.parts.append(q.codes)
            self.scales.append(q.scales)
            return dequantize_fp4(q)
        q = quantize(x, bits=self.bits, block=self.cfg.block)
        self.parts.append(q.codes)
        self.scales.append(q.scales)
        return dequantize(q)

    def finish(self, out: pb.EncodedTensor) -> list[Section]:
        """Describe the payload in `out`; return its raw sections."""
        out.CopyFrom(encoding_of(self.cfg, self.numel, whole=self.whole))
        if self.cfg.kind == "fp16":
            return [[self.half]]
        if self.cfg.kind == "topk":
            if not self.numel:
                return []
            sparse = pack_topk(self.parts, self.topk, self.cfg.topk_bits)
            return [[sparse.signs], [sparse.levels], [sparse.magnitudes], [sparse.low], [sparse.high]]
        return [self.parts, self.scales]


class PayloadReader(ABC):
    """A received payload, checked whole, whose values are decoded a slice at a time: the same bits
    on every machine (outer.py's rule: decoding copies bf16/fp16 numbers or makes one rounded multiply)."""

    def __init__(self, numel: int):
        self.numel = numel

    @staticmethod
    def of(encoded: pb.EncodedTensor, sections: Sequence[memoryview], numel: int) -> PayloadReader:
        """Raises ValueError for a payload that is malformed, of another size, or not finite."""
        which = encoded.WhichOneof("encoding")
        expected = {"fp16": 1, "quantized": 2, "fp4": 2, "sparse": 5 if numel else 0}.get(which or "")
        if expected is None:
            raise ValueError("no encoding")
        if len(sections) != expected:
            raise ValueError(f"{len(sections)} sections for a {which} payload, expected {expected}")
        if which == "fp16":
            return _Fp16Reader(sections[0], numel)
        if which == "quantized":
            return _QuantizedReader(encoded.quantized, *sections, numel=numel)
        if which == "fp4":
            q = pb.QuantizedTensor(bits=4, block=encoded.fp4.block)
            return _QuantizedReader(q, *sections, numel=numel, fp4=True)
        return _SparseReader(encoded.sparse, sections, numel)

    @abstractmethod
    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Values [lo, hi) as fp32 (lo on a slice boundary)."""

    def read_all(self) -> torch.Tensor:
        return self.read(0, self.numel)

    def sparse(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Values [lo, hi) as (positions from lo, int64; their fp32 values): the only ones that may be nonzero, each
        position once; None for a dense payload (`read` then)."""
        return None

    def norm(self, step: int) -> float:
        """The payload's L2 norm (float64), decoded `step` values at a time (lo on a slice boundary); inf or nan if
        it holds them. Its bits depend on the payload alone (its own slices, summed in a fixed order:
        average.fixed_order_sum), so every member that screens it screens it alike on any CPU and thread count."""
        total = 0.0
        for lo in range(0, self.numel, step):
            total += fixed_order_sum(self.read(lo, min(lo + step, self.numel)).double().square())
        return math.sqrt(total) if math.isfinite(total) else total


class _Fp16Reader(PayloadReader):
    def __init__(self, data: memoryview, numel: int):
        super().__init__(numel)
        if len(data) % 2:
            raise ValueError(f"{len(data)} bytes of fp16 values")
        self.values = read_only_tensor(data, torch.float16)
        if self.values.numel() != numel:
            raise ValueError(f"{self.values.numel()} fp16 values, expected {numel}")
        if not all_finite([self.values]):
            raise ValueError("it holds NaN or Inf")

    def read(self, lo: int, hi: int) -> torch.Tensor:
        return self.values[lo:hi].to(torch.float32)


class _QuantizedReader(PayloadReader):
    def __init__(self, q: pb.QuantizedTensor, codes: memoryview, scales: memoryview, *, numel: int, fp4: bool = False):
        super().__init__(numel)
        self.fp4 = fp4
        if q.bits not in (4, 8) or q.block < 1:
            raise ValueError(f"bits {q.bits}, block {q.block}")
        if len(scales) != 2 * -(-numel // q.block):
            raise ValueError(f"{len(scales)} scale bytes for {numel} values in blocks of {q.block}")
        expected = numel if q.bits == 8 else -(-numel // 2)
        if len(codes) != expected:
            raise ValueError(f"{q.bits}-bit codes: {len(codes)} bytes for {numel} values (expected {expected})")
        self.codes, self.scales, self.bits, self.block = codes, scales, q.bits, q.block
        widest = torch.from_numpy(np.frombuffer(self.scales, dtype=np.int16).copy()).view(torch.bfloat16)
        if not bool(torch.isfinite(widest.to(torch.float32) * 128).all()):  # |code| <= 128
            raise ValueError("it holds NaN or Inf")

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """lo must start a block (and, for int4, an even value): slices do (module docstring)."""
        per_byte = 2 if self.bits == 4 else 1
        codes = self.codes[lo // per_byte : -(-hi // per_byte)]
        scales = self.scales[2 * (lo // self.block) : 2 * -(-hi // self.block)]
        q = Quantized(codes, scales, (hi - lo,), self.bits, self.block)
        return dequantize_fp4(q) if self.fp4 else dequantize(q)


class _SparseReader(PayloadReader):
    def __init__(self, s: pb.SparseTensor, sections: Sequence[memoryview], numel: int):
        super().__init__(numel)
        # a part of a message (the compressed butterfly) may be shorter than one of its chunks
        if not (1 <= s.k <= s.chunk <= TOPK_MAX_CHUNK and s.bits in (2, 3, 4)):
            raise ValueError(f"chunk {s.chunk}, k {s.k}, bits {s.bits}")
        self.layout = TopKLayout(numel, s.chunk, s.k)
        self.kept: Kept | None = None
        if numel:
            self.kept = unpack_topk(SparseChunks(self.layout, s.bits, *sections))

    def read(self, lo: int, hi: int) -> torch.Tensor:
        """lo must start a chunk: slices do (module docstring)."""
        chunk = self.layout.chunk
        first, stop = lo // chunk, -(-hi // chunk)
        assert self.kept is not None, "an empty payload has no values to read"
        return self.kept.dense(first, stop, chunk)[: hi - lo]

    def sparse(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.layout.chunk
        first, stop = lo // chunk, -(-hi // chunk)
        assert self.kept is not None, "an empty payload has no values to read"
        positions = self.kept.index[first:stop].long() + torch.arange(stop - first)[:, None] * chunk
        values = self.kept.values(first, stop)
        inside = positions < hi - lo  # the last chunk of a tensor may end past it (padding)
        return positions[inside], values[inside]

    def norm(self, step: int) -> float:
        """The L2 norm of the kept values alone (the zeros between them add nothing), in chunk order: a function of
        the payload alone, as PayloadReader.norm, at 1/density less work."""
        if self.kept is None:
            return 0.0
        chunk = self.layout.chunk
        values = self.kept.values()
        inside = self.kept.index.long() + torch.arange(values.shape[0])[:, None] * chunk < self.numel
        total = fixed_order_sum(values[inside].double().square())
        return math.sqrt(total) if math.isfinite(total) else total


class ScaledReader(PayloadReader):
    """Another reader's values times `scale` (average.bound's clip): one rounded float32 multiply per value."""

    def __init__(self, reader: PayloadReader, scale: float):
        super().__init__(reader.numel)
        self.reader, self.scale = reader, scale

    def read(self, lo: int, hi: int) -> torch.Tensor:
        return self.reader.read(lo, hi).mul(self.scale)

    def sparse(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        kept = self.reader.sparse(lo, hi)
        return None if kept is None else (kept[0], kept[1].mul(self.scale))


def streamed_mean(
    readers: Sequence[PayloadReader], layout: FlatLayout, step: int
) -> list[torch.Tensor]:
    """The mean of the readers' payloads, in the given order, as tensors shaped like the layout's
    pieces: `ordered_mean` slice by slice (the same bits as over whole tensors)."""
    out = [torch.empty(s, dtype=torch.float32) for s in layout.shapes]
    for lo, hi in layout.slices(step):
        mean = _sparse_mean(readers, lo, hi)
        if mean is None:
            mean = ordered_mean((r.read(lo, hi) for r in readers), torch.Size((hi - lo,)))
        layout.write(out, lo, hi, mean)
    return out


def _sparse_mean(readers: Sequence[PayloadReader], lo: int, hi: int) -> torch.Tensor | None:
    """`ordered_mean` of sparse payloads' slices [lo, hi) without their zeros, bit for bit (None where a payload is
    dense). The float64 sum starts as the first payload's values and adds each other's where it keeps one: a zero
    it skips (x + 0.0) changes nothing, unless x is -0.0, which only the first payload can put there (a sum of
    f32 numbers in f64 is -0.0 only if both are): a slice whose first payload keeps a -0.0 goes the dense way."""
    kept = []
    for reader in readers:
        pair = reader.sparse(lo, hi)
        if pair is None:
            return None
        kept.append(pair)
    if not kept:
        return None
    first_positions, first_values = kept[0]
    if bool(((first_values == 0) & first_values.signbit()).any()):
        return None
    total = torch.zeros(hi - lo, dtype=torch.float64)
    total[first_positions] = first_values.double()
    for positions, values in kept[1:]:
        total.index_put_((positions,), values.double(), accumulate=True)  # each position once: exact, any order
    return total.div_(len(kept)).to(torch.float32)
