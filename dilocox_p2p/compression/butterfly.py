"""The compressed butterfly: compressed messages reduce-scattered, then the reduced parts all-gathered.

    spans = part_spans(message, n)                     # member i of the group reduces values spans[i]
    parts = cut_all(message, n)                        # parts[i]: values spans[i] of the message, its own bytes
    reduced = reduce(round_codec, parts_of_span_i, span=spans[i])      # on reducer i: the group's parts of spans[i]
    average = assemble(round_codec, reduced_parts, spans=spans, own=j)  # on every member j: all reducers' parts

For the quantizers (fp16, int8, fp4) a message's vector is cut at quantization blocks into one
span per reducer, as hivemind's butterfly cuts fp32 tensors: every member of the group, or all but its
client members (swarm/client_member.py: they send their parts and reduce nothing; `reducers=`). Each member sends
each reducer the encoded bytes of that reducer's span (no re-encoding: a block's codes and scale
travel as they are). The reducer decodes the parts, leaves out those that are not finite or
outsized (average.screen: one party decides, for every member), sums the rest in group order in
float64, divides once, encodes the mean once with the same quantizer and serves the *same bytes*
to every member, behind its own signed digest, naming the members it averaged (`used`). Every
member, the reducer too, applies what those bytes decode to, so every member holds the same bits.

Bytes per member and round: (N - 1)/N of a message out to the reducers and (N - 1)/N in from
them, the same again for the reduced parts: 2 (N - 1)/N of a message each way, flat in N, against
N - 1 messages for the all-gather (gather.py).

Top-k (topk.py) is cut at its chunks (a part holds its author's kept values of the span's chunks, packed
on their own: a chunk's index bits are not whole bytes; a part's chunks are the whole message's, the last
one cut short). The reducer averages the parts' values as for the quantizers, keeps the largest m k of
each chunk of that mean (m: `compression.topk_reduced_multiple`, 3 by default; transport.reduced_config)
and serves those bytes: up to N k values of a chunk come in, m k go out, and what it dropped waits in its
own error feedback (below). Bytes: (N-1)/N (1 + R) messages each way, R about 2.4 at m = 3 (denser chunks
take fewer index bits), where the all-gather (`compression.topk_transport`: transport.py) sends N - 1
messages but averages every member's kept values as sent.

Low-rank (lowrank.py) is linear in both phases, so each rides the butterfly in turn: P = M Q at
the group's ranks (`low_rank_second` takes the assembled mean of P to the basis B and this
worker's Q' = M^T B), then Q'; every part of phase 2 names the reduced phase-1 parts its basis
came from (`Assembled.digest`), and a part in another basis is left out at no fault.

Nothing is lost to the second quantization (or top-k's second selection): the reducer keeps the rounding
of its mean in its own error-feedback buffer on its span, times the number of members averaged (the mean's rounding,
spread over the next group, adds back what this one missed), so that what every member applied
plus every buffer adds up to what was sent, to rounding (`test_butterfly.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..average import Spans, against_the_group, bound, intersect_spans
from ..proto_gen import compression_pb2 as pb
from .codec import NOT_RECEIVED, OTHER_BASIS, Decoded, MessageRejected, RoundCodec, StageCodec
from .lowrank import basis_digest
from .payload import FlatLayout, PayloadReader, ScaledReader, encode_payload, frame, slice_step, streamed_mean, unframe
from .topk import Kept, SparseChunks, TopKLayout, pack_topk, unpack_topk
from .transport import reduced_config

__all__ = ["REDUCED", "Assembled", "Reduced", "assemble", "cut", "cut_all", "low_rank_average", "low_rank_second", "part_spans",
           "receive_part", "reduce", "reduced_phase", "reducer_spans", "rides_butterfly", "settle", "settle_applied", "span_unit", "unpadded"]  # fmt: skip

REDUCED = 3
"""The phase of a reduced part (phases 1 and 2 are a message's own: codec.py)."""


def rides_butterfly(blob: bytes, group_size: int) -> bool:
    """Whether a framed phase-1 message rides the butterfly in a group of `group_size` (its author's codec says from
    which size: transport.butterfly_from), rather than the all-gather."""
    message, _ = unframe(blob)
    return 0 < message.butterfly_from <= group_size


def span_unit(encoding: pb.EncodedTensor) -> int:
    """Values per unit that spans start on: two blocks for blockwise codes (so that a part's codes and
    scales are whole bytes and whole blocks of the message's), 64 values for fp16."""
    which = encoding.WhichOneof("encoding")
    if which == "quantized":
        return 2 * encoding.quantized.block
    if which == "fp4":
        return 2 * encoding.fp4.block
    if which == "fp16":
        return 64
    if which == "sparse":
        return encoding.sparse.chunk
    raise ValueError(f"a {which or 'bare'} payload cannot be cut into parts")


def reducer_spans(numel: int, n: int, unit: int) -> list[tuple[int, int]]:
    """The values [lo, hi) each of `n` reducers owns: contiguous, in group order, as equal as whole units
    allow (a member may own none of a vector shorter than n units)."""
    if n < 1 or unit < 1:
        raise ValueError(f"{n} reducers in units of {unit}")
    units = -(-numel // unit)
    bounds = [min(numel, (i * units // n) * unit) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def cut(blob: bytes, lo: int, hi: int, *, parts: int) -> bytes:
    """The part of a framed message (payload.frame) that holds its values [lo, hi), framed on its own: the
    header of the message with the span, then the slices of its sections (`lo` on a span unit; top-k: the
    chunks of the span, packed on their own)."""
    message, sections = unframe(blob)
    return _cut(message, sections, lo, hi, parts=parts, kept=_kept(message, sections))


def _kept(message: pb.CompressedMessage, sections: Sequence[memoryview]) -> Kept | None:
    """A top-k message's kept values, unpacked (None for other encodings)."""
    if message.payload.WhichOneof("encoding") != "sparse" or not sections:
        return None
    s = message.payload.sparse
    return unpack_topk(SparseChunks(TopKLayout(int(message.payload.shape[0]), s.chunk, s.k), s.bits, *sections))


def _cut(
    message: pb.CompressedMessage, sections: Sequence[memoryview], lo: int, hi: int, *, parts: int, kept: Kept | None
) -> bytes:
    numel = int(message.payload.shape[0])
    if not 0 <= lo <= hi <= numel or lo % span_unit(message.payload):
        raise ValueError(f"values [{lo}, {hi}) of a {numel}-value message")
    which = message.payload.WhichOneof("encoding")
    if which == "sparse":
        s = message.payload.sparse
        cut_sections = []
        if hi > lo and kept is not None:  # chunks [first, stop): repacked (a chunk's index bits are not whole bytes)
            first, stop = lo // s.chunk, -(-hi // s.chunk)
            part = Kept(kept.index[first:stop], kept.levels[first:stop], kept.negative[first:stop],
                        kept.magnitudes[first:stop])  # fmt: skip
            packed = pack_topk([part], TopKLayout(hi - lo, s.chunk, s.k), s.bits)
            cut_sections = [[packed.signs], [packed.levels], [packed.magnitudes], [packed.low], [packed.high]]
    elif which == "fp16":
        cut_sections = [[sections[0][2 * lo : 2 * hi]]]
    else:
        block = message.payload.quantized.block if which == "quantized" else message.payload.fp4.block
        per_byte = 2 if which == "fp4" or message.payload.quantized.bits == 4 else 1
        codes = sections[0][lo // per_byte : -(-hi // per_byte)]
        scales = sections[1][2 * (lo // block) : 2 * -(-hi // block)]
        cut_sections = [[codes], [scales]]
    header = pb.CompressedMessage()
    header.CopyFrom(message)
    header.payload.shape[:] = [hi - lo]
    header.span_lo, header.span_hi, header.parts = lo, hi, parts
    return frame(header, cut_sections)


def part_spans(blob: bytes, n: int) -> list[tuple[int, int]]:
    """The reducer spans of a framed message cut for a group of `n`."""
    message, _ = unframe(blob)
    return reducer_spans(int(message.payload.shape[0]), n, span_unit(message.payload))


def cut_all(blob: bytes, n: int) -> list[bytes]:
    """A framed message's parts for a group of `n`, in reducer order."""
    message, sections = unframe(blob)
    kept = _kept(message, sections)
    return [_cut(message, sections, lo, hi, parts=n, kept=kept) for lo, hi in part_spans(blob, n)]



@dataclass
class Reduced:
    """A reducer's mean of its span, framed (the same bytes for every member), and its outcome."""

    blob: bytes
    used: list[int]
    """Group indices of the members whose parts it averaged."""
    rejected: dict[int, str] = field(default_factory=dict)
    """Group index -> why that member's part was left out (codec.NOT_RECEIVED: it never came)."""
    energies: list[tuple[list[float], list[float]]] = field(default_factory=list)
    """Low-rank phase 2: the (energy_total, energy_kept) lists of the members averaged, as their parts said."""


@dataclass
class Assembled:
    """The group's average put together from the reduced parts of every reducer."""

    tensors: list[torch.Tensor]
    """The pieces of the phase's layout: the stage's tensors for the quantizers (codec.pieces)."""
    used: list[int]
    """Group indices of the members some reducer averaged."""
    missing: Spans = ()
    """Coordinates (of the pieces laid end to end, no padding) whose reduced part never came or was refused, or
    averaged nobody: zeros here, to be mended from members that hold them (exchange.py)."""
    refused: dict[int, str] = field(default_factory=dict)
    """Reducer index -> why its reduced part was refused (codec.NOT_RECEIVED: it never came)."""
    empty: int = 0
    """Reducers whose span averaged no member's part (every part left out): their spans are missing too."""
    counted: Spans = ()
    """Spans of the phase's message (its padded layout) whose reducer averaged this worker's part: what leaves its
    error-feedback buffer once the average it applies is this one (`settle`)."""
    phase: int = 1
    """The phase assembled: 1 (the message's spans) or 2 (low-rank's factors), for `settle`."""
    by_reducer: tuple[tuple[int, ...] | None, ...] = ()
    """Per reducer (in the order of `spans`): the group indices of the members its reduced part averaged; None
    where that part never came or was refused. What a copy of this average tells a member that fills its holes
    from it: whether each span it takes counted that member's part (`settle_applied`)."""
    digest: bytes = b""
    """Names the reduced parts assembled (lowrank.basis_digest over those present; low-rank's phase 1 only):
    low-rank's phase-2 basis. A reduced part no member could get (its reducer died before serving it) is zeros
    alike on every member."""


def reduced_phase(phase: int) -> int:
    """The phase of the reduced parts of a message's `phase`: REDUCED for phase 1, one more for low-rank's 2."""
    return REDUCED + phase - 1


def expected_ranks(rc: RoundCodec, phase: int) -> list[int]:
    """The ranks every part of `phase` must carry: the group's agreed ranks (phase 1), the basis' (phase 2)."""
    codec = rc.codec
    return [codec.ranks[i] if phase == 1 else rc.bases[i].rank for i in codec.factored]


def reduce(
    rc: RoundCodec, parts: Sequence[bytes | None], *, span: tuple[int, int], phase: int = 1, reducers: int | None = None
) -> Reduced:
    """Reducer side: the group's parts of this reducer's `span` of the `phase` messages (in group order, None:
    never came) to the reduced part every member applies; `reducers`: how many reducers the messages were cut for
    (default: every member; fewer where the group has client members: swarm/client_member.py). The rounding of the
    mean goes into this worker's error-feedback buffer (for low-rank's factors, as B times it)."""
    codec, (lo, hi), members = rc.codec, span, len(parts)
    n = members if reducers is None else reducers
    ranks = expected_ranks(rc, phase)
    layout = FlatLayout(codec.pieces(phase, ranks), codec.pad)  # the whole message's: top-k's chunks, the feedback
    readers: dict[int, PayloadReader] = {}
    energies: dict[int, tuple[list[float], list[float]]] = {}
    rejected: dict[int, str] = {}
    for index, blob in enumerate(parts):
        if blob is None:
            rejected[index] = NOT_RECEIVED
            continue
        try:
            message, readers[index] = receive_part(codec, blob, round=rc.round, phase=phase, span=span, parts=n,
                                                   members=members, ranks=ranks, basis=rc.basis if phase == 2 else b"", whole=layout.numel)  # fmt: skip
            energies[index] = (list(message.energy_total), list(message.energy_kept))
        except MessageRejected as e:
            rejected[index] = str(e)
    step = slice_step(codec.cfg, hi - lo)
    refused, scales = bound({i: r.norm(step) for i, r in readers.items()}, codec.max_norm_ratio, codec.clip_ratio)
    if codec.direction_screen:  # low-rank's too: P_i = M_i Q and Q_i = M_i^T B share Q and B, so signs compare
        refused |= against_the_group({i: r.read for i, r in readers.items() if i not in refused}, hi - lo)
    rejected.update(refused)
    readers = {i: ScaledReader(r, scales[i]) if i in scales else r for i, r in readers.items() if i not in refused}
    used = sorted(readers)
    mean = streamed_mean([readers[i] for i in used], FlatLayout([torch.Size((hi - lo,))], 1), step)[0]
    message = pb.CompressedMessage(codec=codec.cfg.kind, round=rc.round, phase=reduced_phase(phase), span_lo=lo,
                                   span_hi=hi, parts=n, used=used, ranks=ranks, basis=rc.basis if phase == 2 else b"")  # fmt: skip
    sections, decoded = encode_payload(reduced_config(codec.cfg), [mean], pad=1, out=message.payload, keep=True,
                                       whole=layout.numel)  # fmt: skip
    assert decoded is not None
    with codec.lock:
        if rc.from_buffer and used and rc.generation == codec.generation:
            # what the second rounding left out of the group's sum, sent again in this worker's later messages
            rounding = decoded[0].sub_(mean).mul_(len(used))  # -(mean - decoded) * members
            if phase == 1:  # never into P's coordinates: P only steers the basis
                layout.subtract([None if f else b for f, b in zip(codec.lowrank, codec.feedback.buffers)], lo, hi, rounding)
            else:
                rc.subtract_factors(layout, lo, hi, rounding)
    return Reduced(frame(message, sections), used, rejected, [energies[i] for i in used])


def assemble(
    rc: RoundCodec, reduced: Sequence[bytes | None], *, spans: Sequence[tuple[int, int]], own: int, phase: int = 1,
    group_size: int | None = None,
) -> Assembled:
    """Member side: the reduced parts of every reducer of `phase` (in group order, None: never came) to the mean
    of the phase's pieces, with the spans whose reducer averaged this worker's part (`own`: its group index;
    `group_size`: default one reducer per member). The buffer is left alone: the caller settles once it knows
    which average it applies (`settle`), this one or another (a borrowed one: RoundCodec.settle) or none."""
    codec, ranks = rc.codec, expected_ranks(rc, phase)
    layout = FlatLayout(codec.pieces(phase, ranks), codec.pad)
    out = [torch.zeros(s, dtype=torch.float32) for s in layout.shapes]
    used: set[int] = set()
    counted: list[tuple[int, int]] = []
    by_reducer: list[tuple[int, ...] | None] = [None] * len(spans)
    missing: list[tuple[int, int]] = []
    refused: dict[int, str] = {}
    empty = 0
    for index, (blob, (lo, hi)) in enumerate(zip(reduced, spans, strict=True)):
        if lo == hi:
            by_reducer[index] = ()
            continue
        try:
            if blob is None:
                raise MessageRejected(NOT_RECEIVED)
            message, reader = receive_part(codec, blob, round=rc.round, phase=reduced_phase(phase), span=(lo, hi),
                                           parts=len(spans), members=group_size, ranks=ranks,
                                           basis=rc.basis if phase == 2 else b"",
                                           whole=layout.numel)  # fmt: skip
        except MessageRejected as e:
            refused[index] = str(e)
            missing.append((lo, hi))
            continue
        members = list(message.used)
        by_reducer[index] = tuple(members)
        if not members:  # alike on every member: applied nowhere (the mean of none is no zero step)
            empty += 1
            missing.append((lo, hi))
            continue
        used.update(members)
        if own in members:
            counted.append((lo, hi))
        step = slice_step(codec.cfg, hi - lo)
        for a in range(0, hi - lo, step):
            b = min(a + step, hi - lo)
            layout.write(out, lo + a, lo + b, reader.read(a, b))
    present = [i for i, blob in enumerate(reduced) if blob is not None and i not in refused]
    # what a low-rank basis of this mean came from (members that hold the same agree); nothing else reads it, and
    # hashing a quantized stage's reduced parts cost a sixth of its assembly
    digest = basis_digest(reduced, present) if phase == 1 and codec.factored else b""
    return Assembled(out, sorted(used), unpadded(layout, missing), refused, empty, tuple(counted), phase,
                     tuple(by_reducer), digest)


def settle(rc: RoundCodec, *steps: Assembled) -> None:
    """This worker applies the average its `steps` assembled (low-rank: both phases'): its message leaves its
    error-feedback buffer on the spans each step's reducers averaged, and stays on the rest, to be sent again."""
    for step in steps:
        total = _phase_layout(rc, step.phase).numel
        if step.phase == 1:
            rc.settle_spans(step.counted, total)
        else:
            rc.settle_factor_spans(step.counted, total)


def settle_applied(
    rc: RoundCodec, spans: Sequence[tuple[int, int]], counted_by: Sequence[tuple[str, ...] | None], *, me: str,
    missing: Spans,
) -> None:  # fmt: skip
    """This worker applies a copy of its group's average (its own assembly, mended or not, or the majority's in
    phase 5) whose reducers of the phase-1 message's `spans` averaged the members `counted_by` says (None: not
    known), less its `missing` coordinates: its message leaves its error-feedback buffer on the spans that
    counted `me` and were applied, and stays on the rest, to be sent again. A span filled from a copy that did
    not say whom it counted stays (it may be sent twice, never lost)."""
    layout = _phase_layout(rc, 1)
    counted = [
        (lo, hi) for (lo, hi), members in zip(spans, counted_by, strict=True)
        if lo < hi and members is not None and me in members and not intersect_spans(unpadded(layout, [(lo, hi)]), missing)
    ]  # fmt: skip
    rc.settle_spans(counted, layout.numel)


def _phase_layout(rc: RoundCodec, phase: int) -> FlatLayout:
    """The padded layout of this worker's `phase` message at the ranks it must carry: what its spans index."""
    return FlatLayout(rc.codec.pieces(phase, expected_ranks(rc, phase)), rc.codec.pad)


def low_rank_second(rc: RoundCodec, phase1: Assembled) -> bytes:
    """Low-rank: this worker's phase-2 message from the group's assembled phase-1 mean (`phase1.digest` names the
    reduced parts it holds, and binds the message to the basis they give)."""
    codec = rc.codec
    tensors = [p.T.contiguous() if codec.lowrank[i] else p for i, p in enumerate(phase1.tensors)]  # P is (n, r)
    with codec.lock:
        return rc.second_from(Decoded(tensors, used=phase1.used), phase1.digest)


def low_rank_average(rc: RoundCodec, phase2: Assembled, energies: Sequence[tuple[list[float], list[float]]]) -> list[torch.Tensor]:
    """Low-rank: the average from the group's assembled mean Q'^T (phase 2) and the phase-1 mean; `energies`: the
    members' (energy_total, energy_kept) lists this worker's reduce saw (Reduced.energies)."""
    with rc.codec.lock:
        return rc.finish_factors([qt.T.contiguous() for qt in phase2.tensors], energies)


def receive_part(
    codec: StageCodec, blob: bytes, *, round: int, phase: int, span: tuple[int, int], parts: int,
    members: int | None = None, ranks: Sequence[int] = (), basis: bytes = b"", whole: int | None = None,
) -> tuple[pb.CompressedMessage, PayloadReader]:  # fmt: skip
    """Parse and check a part of a `phase` message or a reduced part (`reduced_phase`) of `span`, cut for `parts`
    reducers of a group of `members` (default: as many), at `ranks` and (low-rank phase 2) in `basis`, from a
    message of `whole` values (top-k's chunks are the message's). Raises MessageRejected."""
    members = parts if members is None else members
    lo, hi = span
    message, sections = codec.parse(blob)
    said = (message.codec, message.round, message.phase, message.span_lo, message.span_hi, message.parts)
    if said != (codec.cfg.kind, round, phase, lo, hi, parts):
        raise MessageRejected(f"a {message.codec} part of round {message.round} phase {message.phase}, values "
                              f"[{message.span_lo}, {message.span_hi}) of {message.parts} parts")  # fmt: skip
    if list(message.ranks) != list(ranks):
        raise MessageRejected(f"ranks {list(message.ranks)}, the group's are {list(ranks)}")
    if message.basis != basis:  # its factors are in another basis: a loss on the way, not its author's fault
        raise MessageRejected(OTHER_BASIS)
    if list(message.used) != sorted(set(message.used)) or any(not 0 <= i < members for i in message.used):
        raise MessageRejected(f"members {list(message.used)} are not indices of a group of {members}")
    return message, codec.payload_reader(message, sections, hi - lo, factors=len(ranks) if phase == 2 else None,
                                         whole=whole, reduced=phase >= REDUCED)  # fmt: skip


def unpadded(layout: FlatLayout, spans: Sequence[tuple[int, int]]) -> Spans:
    """Spans of a padded layout as spans of its pieces laid end to end without padding (the averager's
    coordinates: held.py), adjacent ones merged."""
    starts = [0]
    for shape in layout.shapes:
        starts.append(starts[-1] + shape.numel())
    out: list[tuple[int, int]] = []
    for lo, hi in spans:
        for index, a, b, _ in layout.overlaps(lo, hi):
            span = (starts[index] + a, starts[index] + b)
            if out and out[-1][1] == span[0]:
                out[-1] = (out[-1][0], span[1])
            else:
                out.append(span)
    return tuple(out)
