"""One stage's compression: its pseudo-gradient into messages, the group's messages into the average.

    codec = StageCodec(cfg, names, shapes, run_id=...)
    round_codec = codec.begin(round, delta)          # delta joins the error-feedback buffer
    m1 = round_codec.message(1)                       # bytes for the stage group (all-gathered)
    m2 = round_codec.message(2, gathered_1)           # low-rank only: from the group's phase-1 messages
    average = round_codec.average(gathered_last)      # the decoded mean of the group's last messages

Every member decodes the same set of messages (the gather relays what a member missed) in the
same order (the group's), sums them in float64 in that order and casts once, so every member
holds the same bits on any CPU (outer.py's rule). A message that does not decode (malformed,
wrong shapes, non-finite) is left out, by every member alike, and named in `Decoded.rejected`.

Per kind, what travels:
- fp16 / int8: every tensor, as IEEE half / blockwise int8 (quantize.py).
- topk: every tensor as chunked top-k (topk.py).
- lowrank: matrices large enough as two factors over two phases (lowrank.py): P_i = M_i Q,
  then Q_i = M_i^T B with B the exact basis of the group's mean P; the other tensors (biases,
  norms, small matrices) quantized whole in phase 1. Factors and tensors use `factor_bits`.

Local state (error-feedback buffers; low-rank's Q and ranks) is this peer's own: kept in its
checkpoints, never hashed or shared. A peer that joins or jumps starts from an empty buffer
and seeded Qs; its first messages still average correctly (lowrank.py), and it takes the
group's ranks from the messages it receives.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..average import ordered_mean
from ..config import CompressionConfig
from ..proto_gen import compression_pb2 as pb
from .feedback import ErrorFeedback
from .lowrank import Basis, adapt_rank, basis, initial_q, local_basis, reconstruct
from .quantize import Quantized, dequantize, quantize
from .topk import SparseChunks, TopKLayout, decode_topk, encode_topk

__all__ = ["Decoded", "MessageRejected", "RoundCodec", "StageCodec", "is_finite"]



class MessageRejected(ValueError):
    """A member's message that cannot be averaged (the reason says why)."""


def is_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@dataclass
class Decoded:
    """The decoded mean of a phase's messages, and which senders were left out and why."""

    tensors: list[torch.Tensor]
    used: list[int] = field(default_factory=list)
    """Indices (in the given order) of the messages averaged."""
    rejected: dict[int, str] = field(default_factory=dict)


class StageCodec:
    """Compression state and rules of one stage worker."""

    def __init__(self, cfg: CompressionConfig, names: Sequence[str], shapes: Sequence[torch.Size], *, run_id: str):
        if cfg.kind == "none":
            raise ValueError("compression.kind none needs no codec: the butterfly averages fp32")
        self.cfg, self.run_id = cfg, run_id
        self.names, self.shapes = list(names), [torch.Size(s) for s in shapes]
        decay = cfg.effective_feedback_decay
        self.feedback = ErrorFeedback([torch.zeros(s) for s in self.shapes], decay=decay) if decay > 0 else None
        self.lowrank = [cfg.kind == "lowrank" and _factorable(s, cfg) for s in self.shapes]
        self.ranks = {i: cfg.rank for i, f in enumerate(self.lowrank) if f}
        self.qs: dict[int, torch.Tensor] = {}  # the last averaged Q per low-rank matrix (warm start)
        self.last_energy: dict[int, float] = {}

    @property
    def phases(self) -> int:
        return 2 if any(self.lowrank) else 1

    def begin(self, round: int, delta: Sequence[torch.Tensor]) -> RoundCodec:
        if self.feedback is not None:
            target = [b.clone() for b in self.feedback.absorb(delta)]
        else:
            target = [d.detach().to(torch.float32).clone() for d in delta]
        return RoundCodec(self, round, target)

    def reset(self) -> None:
        """Forget this peer's own history (it moved on to the swarm's state)."""
        if self.feedback is not None:
            self.feedback.reset()
        self.qs.clear()

    def metrics(self) -> dict[str, Any]:
        if not any(self.lowrank):
            return {}
        names = {i: self.names[i] for i in self.ranks}
        return {
            "ranks": {names[i]: r for i, r in sorted(self.ranks.items())},
            "energy": {names[i]: round(e, 4) for i, e in sorted(self.last_energy.items())},
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.cfg.kind,
            "feedback": self.feedback.state_dict() if self.feedback is not None else None,
            "ranks": dict(self.ranks),
            "qs": {i: q.clone() for i, q in self.qs.items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved.get("kind") != self.cfg.kind:
            return  # another compression kind: start afresh
        if self.feedback is not None and saved.get("feedback") is not None:
            self.feedback.load_state_dict(saved["feedback"])
        self.ranks.update({int(i): int(r) for i, r in saved.get("ranks", {}).items() if int(i) in self.ranks})
        self.qs = {int(i): q.clone() for i, q in saved.get("qs", {}).items() if int(i) in self.ranks}

    # ----- encoding ------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, *, bits: int | None = None) -> tuple[pb.EncodedTensor, torch.Tensor]:
        """(what travels, what it decodes to)."""
        cfg, out = self.cfg, pb.EncodedTensor(shape=list(x.shape))
        if cfg.kind == "fp16":
            half = x.to(torch.float16)
            out.fp16 = half.numpy().tobytes()
            return out, half.to(torch.float32)
        if cfg.kind == "topk":
            sparse = encode_topk(x, chunk=cfg.topk_chunk, density=cfg.topk_density, bits=cfg.topk_bits)
            out.sparse.CopyFrom(_sparse_pb(sparse))
            return out, decode_topk(sparse, x.shape)
        q = quantize(x, bits=bits or 8, block=cfg.block)
        out.quantized.CopyFrom(pb.QuantizedTensor(codes=q.codes, scales=q.scales, bits=q.bits, block=q.block))
        return out, dequantize(q)

    def _bits(self) -> int:
        return self.cfg.factor_bits if self.cfg.kind == "lowrank" else 8

    def _q_for(self, index: int, round: int) -> torch.Tensor:
        rank, shape = self.ranks[index], self.shapes[index]
        q = self.qs.get(index)
        if q is None or q.shape[0] != shape[1]:
            return initial_q(self.run_id, round, self.names[index], shape[1], rank)
        if q.shape[1] < rank:  # the rank grew: new seeded columns
            extra = initial_q(self.run_id, round, self.names[index], shape[1], rank)[:, q.shape[1] :]
            return torch.cat([q, extra], dim=1)
        return q[:, :rank]

    # ----- decoding ------------------------------------------------------------------------
    @property
    def max_message_bytes(self) -> int:
        """More than any honest message of this stage can take (fp16 of everything, plus framing)."""
        return 4 * sum(s.numel() for s in self.shapes) + 65536

    def decode_message(
        self, blob: bytes, *, round: int, phase: int, expect: Sequence[torch.Size | None]
    ) -> tuple[pb.CompressedMessage, list[torch.Tensor]]:
        """Parse and decode one member's message; `expect` gives each tensor's shape (None: a factor of a
        low-rank matrix, whose rank may vary). Raises MessageRejected."""
        if len(blob) > self.max_message_bytes:
            raise MessageRejected(f"{len(blob)} bytes, more than this stage's messages can take")
        message = pb.CompressedMessage()
        try:
            message.ParseFromString(blob)
        except Exception as e:
            raise MessageRejected(f"malformed ({e})") from None
        if (message.codec, message.round, message.phase) != (self.cfg.kind, round, phase):
            raise MessageRejected(f"a {message.codec} message of round {message.round} phase {message.phase}")
        if len(message.tensors) != len(expect):
            raise MessageRejected(f"{len(message.tensors)} tensors, expected {len(expect)}")
        out = []
        for i, (encoded, shape) in enumerate(zip(message.tensors, expect)):
            got = torch.Size(encoded.shape)
            if shape is not None and got != shape:
                raise MessageRejected(f"tensor {i} has shape {tuple(got)}, expected {tuple(shape)}")
            try:
                tensor = _decode_tensor(encoded, got)
            except (ValueError, RuntimeError) as e:
                raise MessageRejected(f"tensor {i}: {e}") from None
            if not bool(torch.isfinite(tensor).all()):
                raise MessageRejected(f"tensor {i} holds NaN or Inf")
            out.append(tensor)
        return message, out


class RoundCodec:
    """One round's encoding and decoding at one stage worker."""

    def __init__(self, codec: StageCodec, round: int, target: list[torch.Tensor]):
        self.codec, self.round, self.target = codec, round, target
        self.sent: list[torch.Tensor | None] = [None] * len(target)  # what each tensor's messages decode to
        self.bases: dict[int, Basis] = {}
        self.phase1: Decoded | None = None

    def message(self, phase: int, gathered: Sequence[bytes] | None = None) -> bytes:
        codec = self.codec
        out = pb.CompressedMessage(codec=codec.cfg.kind, round=self.round, phase=phase)
        if phase == 1:
            for i, x in enumerate(self.target):
                if codec.lowrank[i]:
                    p = x @ codec._q_for(i, self.round)
                    encoded, _ = codec._encode(p.T.contiguous(), bits=codec._bits())  # factors travel by column
                else:
                    encoded, self.sent[i] = codec._encode(x, bits=codec._bits())
                out.tensors.append(encoded)
            self._feed_back(lambda i: not codec.lowrank[i])
            return out.SerializeToString()
        if phase != 2 or codec.phases != 2 or gathered is None:
            raise ValueError(f"phase {phase} does not exist for {codec.cfg.kind}")
        self.phase1 = self._decode_phase1(gathered)
        for i, x in enumerate(self.target):
            if not codec.lowrank[i]:
                continue
            base = self.bases[i] = basis(self.phase1.tensors[i])
            b = local_basis(base)
            q = x.T @ b
            encoded, decoded_qt = codec._encode(q.T.contiguous(), bits=codec._bits())
            decoded_q = decoded_qt.T
            self.sent[i] = b @ decoded_qt  # this peer's part of the approximation
            out.tensors.append(encoded)
            out.energy_total.append(float(torch.sum(x.double() ** 2)))
            out.energy_kept.append(float(torch.sum(decoded_q.double() ** 2)))
        self._feed_back(lambda i: codec.lowrank[i])
        return out.SerializeToString()

    def average(self, gathered: Sequence[bytes]) -> Decoded:
        """The decoded mean of the group's messages of the last phase, in the given (group) order."""
        codec = self.codec
        if codec.phases == 1:
            return self._decode_all(gathered, phase=1, expect=list(codec.shapes))
        assert self.phase1 is not None, "phase 2 needs the phase-1 messages first"
        low = [i for i, f in enumerate(codec.lowrank) if f]
        decoded, messages, rejected = self._decode_messages(gathered, phase=2, expect=[None] * len(low))
        out = list(self.phase1.tensors)
        for j, i in enumerate(low):
            rank = self.bases[i].rank
            qs = [_fit_rank(d[j].T, rank) for d in decoded.values() if d[j].shape[1] == codec.shapes[i][1]]
            q_mean = ordered_mean(qs, torch.Size((codec.shapes[i][1], rank)))
            out[i] = reconstruct(self.bases[i], q_mean)
            codec.qs[i] = q_mean
            total = math.fsum(m.energy_total[j] for m in messages.values() if len(m.energy_total) > j)
            kept = math.fsum(m.energy_kept[j] for m in messages.values() if len(m.energy_kept) > j)
            energy = kept / total if total > 0 else 1.0
            codec.last_energy[i] = energy
            if codec.cfg.energy_target > 0:
                cfg = codec.cfg
                codec.ranks[i] = adapt_rank(rank, energy, target=cfg.energy_target, low=cfg.rank_min, high=cfg.rank_max)
        return Decoded(out, used=sorted(decoded), rejected={**self.phase1.rejected, **rejected})

    def lost(self) -> None:
        """The messages never reached the group: put what they carried back into the buffer."""
        feedback = self.codec.feedback
        if feedback is not None:
            feedback.sent([-s if s is not None else torch.zeros_like(t) for s, t in zip(self.sent, self.target)])

    # ----- helpers -------------------------------------------------------------------------
    def _feed_back(self, which: Any) -> None:
        feedback = self.codec.feedback
        if feedback is None:
            return
        sent = [s if (which(i) and s is not None) else torch.zeros_like(e) for i, (s, e) in enumerate(zip(self.sent, feedback.buffers))]
        feedback.sent(sent)

    def _decode_phase1(self, gathered: Sequence[bytes]) -> Decoded:
        codec = self.codec
        expect = [None if f else s for s, f in zip(codec.shapes, codec.lowrank)]
        decoded, _, rejected = self._decode_messages(gathered, phase=1, expect=expect)
        ranks = {i: _group_rank([d[i].T for d in decoded.values()], codec.shapes[i][0]) for i in codec.ranks}
        for i, r in ranks.items():
            if r is not None:
                codec.ranks[i] = r
        out = []
        for i, shape in enumerate(codec.shapes):
            if codec.lowrank[i]:
                rank = codec.ranks[i]
                parts = [_fit_rank(d[i].T, rank) for d in decoded.values() if d[i].shape[1] == shape[0]]
                out.append(ordered_mean(parts, torch.Size((shape[0], rank))))
            else:
                out.append(ordered_mean([d[i] for d in decoded.values()], shape))
        return Decoded(out, used=sorted(decoded), rejected=rejected)

    def _decode_messages(
        self, gathered: Sequence[bytes], *, phase: int, expect: Sequence[torch.Size | None]
    ) -> tuple[dict[int, list[torch.Tensor]], dict[int, pb.CompressedMessage], dict[int, str]]:
        """Decode every message, in order: (tensors by index, messages by index, rejected index -> reason)."""
        decoded: dict[int, list[torch.Tensor]] = {}
        messages: dict[int, pb.CompressedMessage] = {}
        rejected: dict[int, str] = {}
        for index, blob in enumerate(gathered):
            try:
                messages[index], decoded[index] = self.codec.decode_message(
                    blob, round=self.round, phase=phase, expect=expect
                )
            except MessageRejected as e:
                rejected[index] = str(e)
        return decoded, messages, rejected

    def _decode_all(self, gathered: Sequence[bytes], *, phase: int, expect: list[torch.Size]) -> Decoded:
        decoded, _, rejected = self._decode_messages(gathered, phase=phase, expect=expect)
        out = [ordered_mean([d[i] for d in decoded.values()], s) for i, s in enumerate(expect)]
        return Decoded(out, used=sorted(decoded), rejected=rejected)


def _factorable(shape: torch.Size, cfg: CompressionConfig) -> bool:
    """A matrix worth factoring: its factors at the lowest rank are well below its size."""
    return len(shape) == 2 and min(shape) > 1 and cfg.rank_min * (shape[0] + shape[1]) * 4 <= shape[0] * shape[1]


def _group_rank(factors: Sequence[torch.Tensor], rows: int) -> int | None:
    """The rank most of the group's messages use for a matrix (ties: the larger), None if none fits."""
    counts = collections.Counter(f.shape[1] for f in factors if f.dim() == 2 and f.shape[0] == rows)
    if not counts:
        return None
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


def _fit_rank(factor: torch.Tensor, rank: int) -> torch.Tensor:
    """A factor cut or zero-padded to `rank` columns (a member that used another rank)."""
    if factor.shape[1] == rank:
        return factor
    if factor.shape[1] > rank:
        return factor[:, :rank].contiguous()
    return torch.cat([factor, torch.zeros(factor.shape[0], rank - factor.shape[1])], dim=1)


def _sparse_pb(s: SparseChunks) -> pb.SparseTensor:
    return pb.SparseTensor(chunk=s.layout.chunk, k=s.layout.k, bits=s.bits, signs=s.signs, levels=s.levels,
                           magnitudes=s.magnitudes, low=s.low, high=s.high)  # fmt: skip


def _decode_tensor(encoded: pb.EncodedTensor, shape: torch.Size) -> torch.Tensor:
    numel = math.prod(shape)
    which = encoded.WhichOneof("encoding")
    if which == "fp16":
        raw = np.frombuffer(encoded.fp16, dtype=np.float16)
        if raw.size != numel:
            raise ValueError(f"{raw.size} fp16 values for shape {tuple(shape)}")
        return torch.from_numpy(raw.astype(np.float32)).reshape(shape)
    if which == "quantized":
        q = encoded.quantized
        if q.bits not in (4, 8) or q.block < 1:
            raise ValueError(f"bits {q.bits}, block {q.block}")
        if len(q.scales) != 2 * -(-numel // q.block):
            raise ValueError(f"{len(q.scales) // 2} scales for {numel} values in blocks of {q.block}")
        return dequantize(Quantized(q.codes, q.scales, tuple(shape), q.bits, q.block))
    if which == "sparse":
        s = encoded.sparse
        layout = TopKLayout(numel, s.chunk, s.k)
        if not (1 <= s.k <= s.chunk and s.chunk >= 1 and s.bits in (2, 3, 4)) or (numel > 0 and s.chunk > max(numel, 1)):
            raise ValueError(f"chunk {s.chunk}, k {s.k}, bits {s.bits}")
        message = SparseChunks(layout, s.bits, s.signs, s.levels, s.magnitudes, s.low, s.high)
        return decode_topk(message, shape)
    raise ValueError("no encoding")
