"""One stage's compression: its pseudo-gradient into messages, the group's messages into the average.

    codec = StageCodec(cfg, names, shapes, run_id=...)
    round_codec = codec.begin(round, delta)          # delta joins the error-feedback buffer
    m1 = round_codec.message(1)                       # bytes for the stage group (butterfly.py cuts it, or all-gathered)
    m2 = round_codec.message(2, gathered_1)           # low-rank only: from the group's phase-1 messages
    average = round_codec.average(gathered_last, own=i)  # the decoded mean of the group's last messages, settled
    round_codec.settle(counted)                       # without an average of its own (borrowed, stranded)

Every member decodes the same set of messages (the gather relays what a member missed) in the
same order (the group's), sums them in float64 in that order and casts once, so every member
holds the same bits on any CPU (outer.py's rule). A message that does not decode (malformed,
wrong shapes, an encoding other than the run's, non-finite, or a norm far above the group's
median: average.screen) is left out, by every member alike, and named in `Decoded.rejected`.
Encoding and the mean run a slice at a time (payload.py): the codec's memory is the
error-feedback buffer, the output and the messages, never a whole flat copy of the stage.

Per kind, what travels: one vector per message, the stage's pieces flattened and concatenated
(one protobuf field, so a stage of many small tensors pays no framing per tensor):
- fp16 / int8 / fp4: every tensor, as IEEE half / blockwise int8 / blockwise E3M0 fp4 (quantize.py).
- topk: every tensor, chunked top-k over the concatenation (topk.py).
- lowrank: matrices large enough as two factors over two phases (lowrank.py): P_i = M_i Q,
  then Q_i = M_i^T B with B the exact basis of the group's mean P; the other tensors (biases,
  norms, small matrices) quantized whole in phase 1. Factors travel transposed (a block of
  the quantization runs along one column) and use `factor_bits`, as do the other tensors.
  A phase-2 message names the phase-1 messages its basis came from (`basis_digest`): one
  computed from another set (its author missed a message) is left out, never averaged in
  another basis.

Error feedback gives up only what was averaged: a message's values leave the buffer when the average
this worker applies, as phase 5 chose it, counted it (`settle_decoded` on `mean`, `butterfly.settle_applied` with
the spans whose reducers counted it, as its copy says, or `settle(True)` for an average borrowed from a group that
counted it), never when it is encoded or assembled. A message that was never received, refused or screened out,
or whose round stranded or tied, stays in the buffer whole and is sent again in later rounds.

Local state (error-feedback buffers; low-rank's Q and ranks) is this peer's own: kept in its
checkpoints, never hashed or shared. A peer that joins or jumps starts from an empty buffer
and seeded Qs; its first messages still average correctly (lowrank.py), and it takes the
group's ranks from the messages it receives.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..average import AGAINST, against_the_group, all_finite, bound, ordered_mean
from ..config import CompressionConfig
from ..proto_gen import compression_pb2 as pb
from .feedback import ErrorFeedback
from .lowrank import (
    Basis,
    adapt_rank,
    basis,
    basis_digest,
    energy,
    factorable,
    fit_rank,
    group_energy,
    group_rank,
    initial_q,
    local_basis,
    reconstruct,
)
from .payload import (
    FlatLayout,
    PayloadReader,
    ScaledReader,
    Section,
    encode_payload,
    encoding_of,
    frame,
    slice_step,
    streamed_mean,
    unframe,
)
from .settlement import Settlement
from .transport import butterfly_from, reduced_config, rides_butterfly

__all__ = ["NO_FAULT", "NOT_RECEIVED", "OTHER_BASIS", "Decoded", "MessageRejected", "Received", "RoundCodec", "StageCodec"]

NOT_RECEIVED = "not received"
"""Why a message a member never got is left out (`Decoded.rejected`)."""
OTHER_BASIS = "its factors are in the basis of another set of phase-1 messages"
"""Why a low-rank phase-2 message of a member that averaged other phase-1 messages is left out: a set that
differs is a loss on the way (the gather relays what it can), not its author's fault. Every other reason is."""
NO_FAULT = frozenset({NOT_RECEIVED, OTHER_BASIS, AGAINST})



class MessageRejected(ValueError):
    """A member's message that cannot be averaged (the reason says why)."""


@dataclass
class Decoded:
    """The decoded mean of a phase's messages, and which senders were left out and why."""

    tensors: list[torch.Tensor]
    used: list[int] = field(default_factory=list)
    """Indices (in the given order) of the messages averaged."""
    rejected: dict[int, str] = field(default_factory=dict)


class StageCodec:
    """Compression state and rules of one stage worker."""

    def __init__(
        self,
        cfg: CompressionConfig,
        names: Sequence[str],
        shapes: Sequence[torch.Size],
        *,
        run_id: str,
        max_norm_ratio: float = 10.0,
        clip_ratio: float = 0.0,
        direction_screen: bool = False,
    ):
        if cfg.kind == "none":
            raise ValueError("compression.kind none needs no codec: the butterfly averages fp32")
        self.cfg, self.run_id, self.max_norm_ratio, self.clip_ratio = cfg, run_id, max_norm_ratio, clip_ratio
        self.direction_screen = direction_screen  # average.against_the_group (low-rank: P and Q' in the shared Q and B)
        self.names, self.shapes = list(names), [torch.Size(s) for s in shapes]
        decay = cfg.effective_feedback_decay
        self.feedback = ErrorFeedback([torch.empty(s, device="meta") for s in self.shapes], decay=decay) if decay > 0 else None
        self.lowrank = [cfg.kind == "lowrank" and factorable(s, cfg.rank_min) for s in self.shapes]
        self.factored = [i for i, f in enumerate(self.lowrank) if f]
        self.ranks = {i: max(1, min(cfg.rank, self.rank_cap(i))) for i in self.factored}
        self.qs: dict[int, torch.Tensor] = {}  # the last averaged Q per low-rank matrix (warm start)
        self.last_energy: dict[int, float] = {}
        self.lock = threading.RLock()  # the exchange thread encodes while the main thread may checkpoint
        self.generation = 0  # reset() counts: a round begun before a reset gives nothing back to the new buffer

    def rank_cap(self, index: int) -> int:
        """The highest rank of a factored matrix: rank_max, or (0) the highest whose factors stay 100x
        below the matrix in fp32; never more than the matrix's smaller side."""
        n, m = self.shapes[index]
        if self.cfg.rank_max:
            return min(self.cfg.rank_max, n, m)
        factor_bytes_per_rank = (n + m) * self.cfg.factor_bits / 8 * (1 + 16 / (self.cfg.factor_bits * self.cfg.block))
        return max(1, min(n, m, int(4 * n * m / 100 / factor_bytes_per_rank)))

    def rides_butterfly(self, group_size: int) -> bool:
        """Whether this stage's phase-1 messages ride the compressed butterfly in a group of `group_size`."""
        return rides_butterfly(self.cfg, group_size)

    @property
    def phases(self) -> int:
        return 2 if self.factored else 1

    @property
    def max_message_bytes(self) -> int:
        """More than any honest message of this stage can take (fp16 of everything, plus framing)."""
        return 4 * sum(s.numel() for s in self.shapes) + 65536

    def begin(self, round: int, delta: Sequence[torch.Tensor]) -> RoundCodec:
        with self.lock:
            if self.feedback is not None and all_finite(delta):
                target = self.feedback.absorb(delta)  # the buffers themselves: encoding reads them first
                return RoundCodec(self, round, target)
            # no feedback, or a delta holding NaN or Inf (only a worker playing hostile sends one: exchange.py);
            # it never enters the buffer, which stays finite, and its message is refused by every member
            target = [d.detach().to(torch.float32) for d in delta]  # the delta is the averager's now
            return RoundCodec(self, round, target, from_buffer=False)

    def reset(self) -> None:
        """Forget this peer's own history (it moved on to the swarm's state)."""
        with self.lock:
            if self.feedback is not None:
                self.feedback.reset()
            self.qs.clear()
            self.generation += 1

    def metrics(self) -> dict[str, Any]:
        if not self.factored:
            return {}
        return {
            "ranks": {self.names[i]: self.ranks[i] for i in self.factored},
            "energy": {self.names[i]: round(e, 4) for i, e in sorted(self.last_energy.items())},
        }

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "kind": self.cfg.kind,
                "feedback": self.feedback.state_dict() if self.feedback is not None else None,
                "ranks": dict(self.ranks),
                "qs": {i: q.clone() for i, q in self.qs.items()},
            }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved.get("kind") != self.cfg.kind:
            return  # another compression kind: start afresh
        with self.lock:
            if self.feedback is not None and saved.get("feedback") is not None:
                self.feedback.load_state_dict(saved["feedback"])
            self.ranks.update({int(i): int(r) for i, r in saved.get("ranks", {}).items() if int(i) in self.ranks})
            self.qs = {int(i): q.clone() for i, q in saved.get("qs", {}).items() if int(i) in self.ranks}

    # ----- layout --------------------------------------------------------------------------
    def pieces(self, phase: int, ranks: Sequence[int]) -> list[torch.Size]:
        """The shapes a message of `phase` concatenates, given the ranks of the factored matrices."""
        rank_of = dict(zip(self.factored, ranks))
        if phase == 2:
            return [torch.Size((rank_of[i], self.shapes[i][1])) for i in self.factored]
        return [torch.Size((rank_of[i], s[0])) if i in rank_of else s for i, s in enumerate(self.shapes)]

    @property
    def pad(self) -> int:
        """Pieces start on a quantization block (int8, fp4, low-rank), so that a block never mixes two."""
        return self.cfg.block if self.cfg.kind in ("int8", "lowrank", "fp4") else 1

    def encode(
        self,
        message: pb.CompressedMessage,
        pieces: Sequence[torch.Tensor],
        *,
        feedback: Sequence[torch.Tensor | None] | None = None,
        keep: bool = False,
    ) -> tuple[list[Section], list[torch.Tensor] | None]:
        """`pieces` as `message`'s payload: its raw sections, for `frame`. What the pieces decode to is
        subtracted from `feedback` (per piece a buffer or None) a slice at a time, and returned if `keep`."""
        return encode_payload(self.cfg, pieces, pad=self.pad, out=message.payload, feedback=feedback, keep=keep)

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
    def parse(self, blob: bytes) -> tuple[pb.CompressedMessage, list[memoryview]]:
        """A message's header and raw sections (a whole message or a butterfly part), within the size this
        stage's messages can take. Raises MessageRejected."""
        if len(blob) > self.max_message_bytes:
            raise MessageRejected(f"{len(blob)} bytes, more than this stage's messages can take")
        try:
            return unframe(blob)
        except Exception as e:
            raise MessageRejected(f"malformed ({e})") from None

    def payload_reader(
        self, message: pb.CompressedMessage, sections: Sequence[memoryview], numel: int, *, factors: int | None = None,
        whole: int | None = None, reduced: bool = False,
    ) -> PayloadReader:  # fmt: skip
        """The reader of a parsed message's payload of `numel` values, once it is encoded as this run encodes them
        and its energies are finite (`factors`: a low-rank phase-2 message, one energy pair per factored matrix;
        `whole`: a butterfly part's, the length of the message it was cut from; `reduced`: a reducer's mean,
        encoded as transport.reduced_config says). Raises MessageRejected."""
        cfg = reduced_config(self.cfg) if reduced else self.cfg
        described, expected = pb.EncodedTensor(), encoding_of(cfg, numel, whole=whole)
        described.CopyFrom(message.payload)
        del described.sections[:]
        if described != expected:  # e.g. fp16 values labelled int8: decodable, but not what this run sends
            raise MessageRejected(f"encoded otherwise: as {_said(described)}, this run's {self.cfg.kind} is "
                                  f"{_said(expected)}")  # fmt: skip
        energy_total, energy_kept = list(message.energy_total), list(message.energy_kept)
        if factors is not None and (len(energy_total) != factors or len(energy_kept) != factors):
            raise MessageRejected("energies missing")
        if not all(math.isfinite(e) and e >= 0 for e in [*energy_total, *energy_kept]):
            raise MessageRejected("energies not finite")
        try:
            return PayloadReader.of(message.payload, sections, numel)
        except (ValueError, RuntimeError) as e:
            raise MessageRejected(str(e)) from None

    def receive(self, blob: bytes, *, round: int, phase: int) -> Received:
        """Parse and check one member's message (its payload whole). Raises MessageRejected."""
        message, sections = self.parse(blob)
        if (message.codec, message.round, message.phase) != (self.cfg.kind, round, phase):
            raise MessageRejected(f"a {message.codec} message of round {message.round} phase {message.phase}")
        ranks = list(message.ranks)
        if len(ranks) != len(self.factored) or any(
            not 1 <= r <= min(self.shapes[i]) for r, i in zip(ranks, self.factored)
        ):
            raise MessageRejected(f"ranks {ranks} do not fit this stage's {len(self.factored)} factored matrices")
        layout = FlatLayout(self.pieces(phase, ranks), self.pad)
        if list(message.payload.shape) != [layout.numel]:
            raise MessageRejected(f"payload of shape {list(message.payload.shape)}, expected [{layout.numel}]")
        reader = self.payload_reader(message, sections, layout.numel, factors=len(ranks) if phase == 2 else None)
        step = slice_step(self.cfg, layout.numel)
        return Received(layout, reader, ranks, list(message.energy_total), list(message.energy_kept),
                        bytes(message.basis), step)  # fmt: skip


@dataclass
class Received:
    """One member's message, checked: its payload readable a slice at a time (the parsed protobuf is
    not kept, so a message costs its payload once)."""

    layout: FlatLayout
    reader: PayloadReader
    ranks: list[int]
    energy_total: list[float]
    energy_kept: list[float]
    basis: bytes = b""
    """Low-rank phase 2: the phase-1 messages its factors' basis came from (`basis_digest`)."""
    step: int = 1
    """Values decoded at a time (payload.slice_step of this message's own length)."""

    def norm(self) -> float:
        """The payload's L2 norm (PayloadReader.norm): the same bits on every member that screens it."""
        return self.reader.norm(self.step)

    def pieces(self) -> list[torch.Tensor]:
        """The payload decoded whole, as the pieces it concatenates (low-rank's small messages)."""
        flat = self.reader.read_all()
        return [flat[o : o + s.numel()].reshape(s) for o, s in zip(self.layout.offsets, self.layout.shapes)]


class RoundCodec(Settlement):
    """One round's encoding and decoding at one stage worker."""

    def __init__(self, codec: StageCodec, round: int, target: list[torch.Tensor], *, from_buffer: bool = True):
        self.codec, self.round, self.target = codec, round, target
        self.from_buffer = from_buffer and codec.feedback is not None  # settle takes the message out of the buffer
        self.bases: dict[int, Basis] = {}
        self.phase1: Decoded | None = None
        self.basis = b""  # basis_digest of the phase-1 messages this worker's basis came from
        self.sent: bytes | None = None  # this worker's phase-1 message: its values leave the buffer once averaged
        self.sent_factors: list[tuple[torch.Tensor, torch.Tensor]] = []  # phase 2: (local basis B, decoded Q^T)
        self.generation = codec.generation
        self.settled = False
        self.settled_factors = False  # the compressed butterfly settles phase 2 on its own (settle_factor_spans)
        self.shares: dict[int, float] = {}

    def use_ranks(self, ranks: Sequence[int]) -> None:
        """Encode at the group's `ranks` (one per factored matrix, agreed before phase 1: the compressed butterfly
        cuts every member's messages alike); each held within [1, the matrix's smaller side]. Other lengths:
        this worker's own ranks (a group of another fragment's tickets cannot be)."""
        codec = self.codec
        with codec.lock:
            if len(ranks) == len(codec.factored):
                for i, r in zip(codec.factored, ranks):
                    codec.ranks[i] = max(1, min(int(r), min(codec.shapes[i])))

    def message(self, phase: int, gathered: Sequence[bytes | None] | None = None) -> bytes:
        """This worker's message of `phase` (phase 2: given the group's phase-1 messages, in group order)."""
        with self.codec.lock:
            if phase == 1:
                return self._first()
            if phase != 2 or self.codec.phases != 2 or gathered is None:
                raise ValueError(f"phase {phase} does not exist for {self.codec.cfg.kind}")
            return self._second(gathered)

    def average(self, gathered: Sequence[bytes | None], *, own: int | None) -> Decoded:
        """The decoded mean of the group's messages of the last phase, in the given (group) order;
        None stands for a message never received. `own`: this worker's index among them (None: it sent
        none); its message leaves the error-feedback buffer if the mean counted it (`settle_decoded`)."""
        with self.codec.lock:
            decoded = self.mean(gathered)
            self.settle_decoded(decoded, own)
            return decoded

    def mean(self, gathered: Sequence[bytes | None]) -> Decoded:
        """`average` without settling: the caller settles once it knows which average it applies."""
        with self.codec.lock:
            return self._mean_of_first(gathered) if self.codec.phases == 1 else self._low_rank_average(gathered)

    # ----- phase 1 -------------------------------------------------------------------------
    def _first(self) -> bytes:
        codec = self.codec
        ranks = [codec.ranks[i] for i in codec.factored]
        pieces = [
            (x @ codec._q_for(i, self.round)).T.contiguous() if codec.lowrank[i] else x
            for i, x in enumerate(self.target)
        ]  # fmt: skip
        message = pb.CompressedMessage(codec=codec.cfg.kind, round=self.round, phase=1, ranks=ranks,
                                       butterfly_from=butterfly_from(codec.cfg))  # fmt: skip
        sections, _ = codec.encode(message, pieces)  # the buffer gives it up once it is averaged (settle)
        self.sent = frame(message, sections)
        return self.sent

    def _mean_of_first(self, gathered: Sequence[bytes | None]) -> Decoded:
        """The mean of the phase-1 messages: whole tensors, and for low-rank the mean P of each matrix
        (at the rank most members used, ties to the larger; other ranks cut or zero-padded)."""
        codec = self.codec
        received, rejected = self._receive_all(gathered, phase=1)
        if not codec.factored:  # whole tensors only: the mean a slice at a time
            readers = [r.reader for r in received.values()]
            layout = FlatLayout(codec.shapes, codec.pad)
            out = streamed_mean(readers, layout, slice_step(codec.cfg, layout.numel))
            return Decoded(out, used=sorted(received), rejected=rejected)
        decoded = {index: r.pieces() for index, r in received.items()}
        ranks = {i: group_rank([d[i].shape[0] for d in decoded.values()]) for i in codec.factored}
        for i, r in ranks.items():
            if r is not None:
                codec.ranks[i] = r
        out = []
        for i, shape in enumerate(codec.shapes):
            if codec.lowrank[i]:
                rank = codec.ranks[i]
                parts = [fit_rank(d[i].T, rank) for d in decoded.values()]
                out.append(ordered_mean(parts, torch.Size((shape[0], rank))))
            else:
                out.append(ordered_mean([d[i] for d in decoded.values()], shape))
        return Decoded(out, used=sorted(decoded), rejected=rejected)

    # ----- phase 2 (low-rank) ----------------------------------------------------------------
    def _second(self, gathered: Sequence[bytes | None]) -> bytes:
        self.phase1 = self._mean_of_first(gathered)
        return self.second_from(self.phase1, basis_digest(gathered, self.phase1.used))

    def second_from(self, phase1: Decoded, digest: bytes) -> bytes:
        """This worker's phase-2 message, given the group's phase-1 mean (P per factored matrix, the tensors sent
        whole) and the digest that names what it came from."""
        codec = self.codec
        self.phase1, self.basis = phase1, digest
        bs, energy_total = [], []
        for i in codec.factored:
            self.bases[i] = basis(self.phase1.tensors[i])
            bs.append(local_basis(self.bases[i]))
            energy_total.append(energy(self.target[i]))
        qts = [(self.target[i].T @ b).T.contiguous() for i, b in zip(codec.factored, bs)]
        message = pb.CompressedMessage(codec=codec.cfg.kind, round=self.round, phase=2, energy_total=energy_total,
                                       ranks=[self.bases[i].rank for i in codec.factored], basis=self.basis)  # fmt: skip
        sections, decoded = codec.encode(message, qts, keep=True)
        assert decoded is not None
        self.sent_factors = list(zip(bs, decoded))  # B B^T M_i leaves the buffer once averaged (settle)
        for qt in decoded:
            message.energy_kept.append(energy(qt))
        return frame(message, sections)

    def _low_rank_average(self, gathered: Sequence[bytes | None]) -> Decoded:
        codec = self.codec
        assert self.phase1 is not None, "phase 2 needs the phase-1 messages first"
        received, rejected = self._receive_all(gathered, phase=2)
        decoded = {index: r.pieces() for index, r in received.items()}
        q_means = []
        for j, i in enumerate(codec.factored):
            rank, cols = self.bases[i].rank, codec.shapes[i][1]
            q_means.append(ordered_mean([fit_rank(d[j].T, rank) for d in decoded.values()], torch.Size((cols, rank))))
        energies = [(list(m.energy_total), list(m.energy_kept)) for m in received.values()]
        out = self.finish_factors(q_means, energies)
        return Decoded(out, used=sorted(decoded), rejected={**self.phase1.rejected, **rejected})

    def finish_factors(self, q_means: Sequence[torch.Tensor], energies: Sequence[tuple[list[float], list[float]]]) -> list[torch.Tensor]:
        """The average: M~ = B Q'^T per factored matrix from the group's mean Q' (m, r), the tensors sent whole as
        phase 1 averaged them; Q' is the next round's Q, and each rank follows the group's captured energy
        (`energies`: each averaged member's (energy_total, energy_kept) lists, as its phase-2 message said)."""
        codec, cfg = self.codec, self.codec.cfg
        assert self.phase1 is not None, "phase 2 needs the phase-1 mean first"
        out = list(self.phase1.tensors)
        for j, i in enumerate(codec.factored):
            out[i] = reconstruct(self.bases[i], q_means[j])
            codec.qs[i] = q_means[j]
            if not energies:  # a client member reduced nothing and saw no energies: it keeps the group's ranks
                codec.ranks[i] = self.bases[i].rank
                continue
            codec.last_energy[i] = energy = group_energy([(total[j], kept[j]) for total, kept in energies])
            if cfg.energy_target > 0:
                high = codec.rank_cap(i)
                low = min(cfg.rank_min, high)
                codec.ranks[i] = adapt_rank(self.bases[i].rank, energy, target=cfg.energy_target, low=low, high=high)
        return out

    # ----- helpers -------------------------------------------------------------------------
    def _receive_all(self, gathered: Sequence[bytes | None], *, phase: int) -> tuple[dict[int, Received], dict[int, str]]:
        """Check every message, in order: (received by index, rejected index -> reason)."""
        received: dict[int, Received] = {}
        rejected: dict[int, str] = {}
        for index, blob in enumerate(gathered):
            if blob is None:
                rejected[index] = NOT_RECEIVED
                continue
            try:
                received[index] = self.codec.receive(blob, round=self.round, phase=phase)
            except MessageRejected as e:
                rejected[index] = str(e)
                continue
            if phase == 2 and received[index].basis != self.basis:
                rejected[index] = OTHER_BASIS
                del received[index]
        # robust aggregation, bounded influence: every member screens and scales the same messages alike (average.bound)
        refused, scales = bound({i: r.norm() for i, r in received.items()}, self.codec.max_norm_ratio, self.codec.clip_ratio)
        kept = {i: r.reader for i, r in received.items() if i not in refused}
        if kept and self.codec.direction_screen:
            refused |= against_the_group({i: r.read for i, r in kept.items()}, next(iter(kept.values())).numel)
        rejected.update(refused)
        return {i: replace(r, reader=ScaledReader(r.reader, scales[i])) if i in scales else r
                for i, r in received.items() if i not in refused}, rejected  # fmt: skip


def _said(encoded: pb.EncodedTensor) -> str:
    """An encoding in a few words, for a refusal."""
    which = encoded.WhichOneof("encoding")
    fields = getattr(encoded, which).ListFields() if which else []
    return f"{which or 'nothing'}({', '.join(f'{f.name}={v}' for f, v in fields)})"
