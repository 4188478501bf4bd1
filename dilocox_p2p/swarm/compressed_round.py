"""Phases 2-4 of a compressed round (a mixin of exchange.RoundExchange).

Quantized kinds (fp16, int8, fp4) and top-k (unless `compression.topk_transport` is gather) ride
the compressed butterfly (compression/butterfly.py): the averager cuts this worker's message into
one part per reducer (every member but the client members: swarm/client_member.py) and hands a reducer
the group's parts of its own span (gather.py's scatter); it
reduces them, the reduced parts are all-gathered, and every member assembles the same average. A reduced part that never reached this worker leaves
its span missing, mended from members that hold it, as in the fp32 butterfly. Low-rank rides
it twice once the group formed: P at the ranks most members' group tickets named, then Q' in
the basis of the assembled P. Top-k with transport gather all-gathers the members' whole messages, which every
member decodes alike (codec.py).

Either way a refused contribution strikes its author: a part or message that came intact (behind
its author's signed digest) and cannot be averaged, or a reduced part a reducer signed that does
not decode. A member whose message or part never came is suspected gone (`gather_suspects`).

The error feedback settles last, on the copy phase 5 chose (`_settled`): this worker's message leaves its buffer
where that copy counted it. A copy of a butterfly round says per reducer whom it counted (Average.counted_by),
also for the spans mended from another member's copy or adopted with the majority's; a tie applies nothing and
gives up nothing. The record's `counted_shares` says how much of the message left.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..average import Average, AverageKind, applies_nothing
from ..compression.butterfly import (
    Assembled,
    Reduced,
    assemble,
    low_rank_average,
    low_rank_second,
    part_spans,
    reduce,
    reduced_phase,
    settle,
    settle_applied,
)
from ..compression.codec import NO_FAULT, NOT_RECEIVED, RoundCodec
from .client_member import reducers_of

if TYPE_CHECKING:
    from .group_round import RoundResult

__all__ = ["CompressedRound", "gather_suspects", "reduced_by_nobody"]

logger = logging.getLogger(__name__)


def reduced_by_nobody(failed_reducers: Iterable[str], outsiders: Iterable[str]) -> bool:
    """Whether the spans that missed a member were reduced by nobody, so that no member holds them and asking the
    others for copies (a whole average each: 0.5 s of a 0.3-0.4 s exchange in the lab at the 1 Gbit/s setting,
    benchmarks/matchmaking_failure.py) cannot fill them: every reducer whose part is missing answered it is in no
    such group (a member whose matchmaking failed after its leader counted it in), or none is (a compressed span
    that averaged nobody is missing alike everywhere)."""
    return set(failed_reducers) <= set(outsiders)


def gather_suspects(group: Sequence[str], rejected: Mapping[int, str], outsiders: Iterable[str], *, me: str) -> list[str]:
    """The members of a compressed round's group whose message never came (`rejected`: index -> why it was left
    out, codec.NOT_RECEIVED), except outsiders: a member that answered it is in no such group (a leader counted it
    in after it had given up on the leader) is alive. Suspected, it was left out of the next rounds' targets,
    whose groups then started without it round after round while it waited alone (CI run of 2026-11-27, a 3-peer
    low-rank round 0). A message that came and was refused (not finite, outsized, malformed) is its author's
    strike, not a sign that it is gone: suspected too, a pair that both sent NaN each went alone the next round
    and their states split."""
    outside = set(outsiders)
    return [group[i] for i, why in rejected.items() if why == NOT_RECEIVED and group[i] != me and group[i] not in outside]


class CompressedRound:
    """Mixin for RoundExchange: a compressed round once matchmaking formed its group."""

    stage: Any
    round: int
    tensors: list
    sw: Any
    averager: Any
    membership: Any
    clock: Any
    _window_start: float
    _grouped: Any
    _borrow: Any
    _agree: Any
    _hold: Any
    _mend: Any
    _log: Any
    abandoned: Any

    def _compressed(self, expected: int) -> Average:
        """Phases 2-4 with compression: gather the group's messages, decode, hold what was applied; the average
        says what share of this worker's message it counted (and so left the error-feedback buffer)."""
        codec = self.stage.codec_for(self.round)
        assert codec is not None
        round_codec = codec.begin(self.round, self.tensors)
        average = self._compressed_round(round_codec, expected)
        share = round_codec.counted_share  # None: nothing settled, the buffer kept the whole message
        return dataclasses.replace(average, counted_share=0.0 if share is None else share)

    def _compressed_round(self, round_codec: RoundCodec, expected: int) -> Average:
        codec = round_codec.codec
        self._digests: list[bytes] = []  # the reducers' signed digests of the reduced parts assembled (phase 5)
        self._outsiders: set[str] = set()  # members that answered they are in no such group (gather.OUTSIDE)
        low_rank = codec.cfg.kind == "lowrank"  # encoded once the group formed, at the ranks most members named
        message = b"" if low_rank else round_codec.message(1)
        self.clock.mark("encode")
        result, failure = self._grouped(expected, payload=message, ranks=[codec.ranks[i] for i in codec.factored])
        if self.abandoned():
            return applies_nothing(AverageKind.ABANDONED, "this peer moved on to the swarm's state", self._window_start)
        if result is not None and result.deferred:
            try:
                return self._low_rank_butterfly(round_codec, result, expected)
            except Exception as e:  # an averager call that failed (its process gone, a timeout): the others' average
                failure = f"{type(e).__name__}: {str(e)[:200]}"
                result = None
        if result is None or result.messages is None:
            # the group may still be gathering (up to allreduce_timeout, both phases): wait that long for its
            # average rather than strand this worker (members that failed too answer at once that they lack it)
            average = self._agree(self._borrow(failure, wait_s=self.stage.deadlines.allreduce))
            if message and average.counted_by:  # a butterfly's copy: its reducers cut every message alike
                by_reducers = self._by_reducers(round_codec, part_spans(message, len(average.counted_by)))
                return self._settled(round_codec, average, average.group_id, by_reducers)
            self._settle_taken(round_codec, average)
            return average
        if codec.rides_butterfly(len(result.group)):
            return self._butterfly(round_codec, message, result, expected)
        return self._gathered(round_codec, result, expected)

    def _butterfly(self, round_codec: RoundCodec, message: bytes, result: RoundResult, expected: int) -> Average:
        """Reduce this worker's span of the group's parts (the step gathered them), all-gather the reduced parts,
        assemble the average; mend the spans whose reduced part never came from members that hold them. The error
        feedback settles on the copy this worker applies, after phase 5: the spans whose reducer counted it."""
        group = result.group
        assembled, _, sent, received = self._reduce_step(round_codec, message, result, group=group, clients=result.clients,
                                                         group_id=result.group_id, phase=1, marks=("phase2", "decode"))  # fmt: skip
        if not assembled.used and not assembled.refused:  # every reducer's span averaged nobody, alike everywhere
            return self._none_averaged(len(group), expected)  # applies nothing: the buffer keeps the whole message
        used = tuple(group[i] for i in assembled.used)
        counted_by = tuple(None if c is None else tuple(group[i] for i in c) for c in assembled.by_reducer)
        kind = AverageKind.PARTIAL if assembled.missing else AverageKind.AVERAGED
        self._hold(assembled.tensors, kind, used, result.group_id, missing=assembled.missing, counted_by=counted_by)
        refused = [result.reducers[i] for i in assembled.refused]
        spans = part_spans(message, len(reducers_of(group, result.clients)))
        if assembled.missing and not reduced_by_nobody(refused, self._outsiders):
            banned = set(self.membership.banned())  # mended from the others' copies, never from a member banned meanwhile
            holed = dataclasses.replace(
                result, group=[p for p in group if p not in banned], missing=assembled.missing, failed_reducers=refused,
                bytes_sent=sent, bytes_received=received,
            )  # fmt: skip
            average = self._mend(holed, tensors=assembled.tensors, counted_by=counted_by)
            if average.kind in (AverageKind.BORROWED, AverageKind.STRANDED):  # its group held nobody else
                # (alone_with_outsiders) it applies another group's average or none, not the spans its own
                # group's reducers averaged
                self._log(average, expected=expected)  # (its message counted as sent)
                agreed = self._agree(average)
                return self._settled(round_codec, agreed, result.group_id, self._by_reducers(round_codec, spans))
            average = dataclasses.replace(average, group=used, digests=tuple(self._digests))
        else:
            average = Average(kind=kind, tensors=assembled.tensors, missing=assembled.missing, group=used,
                              bytes_sent=sent, bytes_received=received, window=(self._window_start, time.time()),
                              group_id=result.group_id, digests=tuple(self._digests), counted_by=counted_by)  # fmt: skip
        self._log(average, expected=expected)
        agreed = self._agree(average, voters=group)  # the whole group votes, also members left out
        return self._settled(round_codec, agreed, result.group_id, self._by_reducers(round_codec, spans))

    def _settled(
        self, round_codec: RoundCodec, average: Average, group_id: bytes, of_group: Callable[[Average], None]
    ) -> Average:
        """Settle the error feedback on the copy of the round's average this worker applies, once phase 5 chose it:
        `of_group(average)` where it is its group's (`group_id`: its own, or the majority's), else whole if that
        copy counted this worker or not at all (a tie: nothing applied; another group's: `_settle_taken`)."""
        if average.kind.applies and average.group_id == group_id:
            of_group(average)
        else:
            self._settle_taken(round_codec, average)
        return average

    def _by_reducers(self, round_codec: RoundCodec, spans: Sequence[tuple[int, int]]) -> Callable[[Average], None]:
        """`_settled`'s rule for a copy of a butterfly round's average (`spans`: this worker's message's reducer
        spans): span by span, where the copy says whom each reducer counted; else whole if it counted this worker."""

        def settle_copy(average: Average) -> None:
            if len(average.counted_by) == len(spans):
                settle_applied(round_codec, spans, average.counted_by, me=self.stage.peer_id, missing=average.missing)
            else:
                self._settle_taken(round_codec, average)

        return settle_copy

    def _low_rank_butterfly(self, round_codec: RoundCodec, result: RoundResult, expected: int) -> Average:
        """Low-rank through the butterfly: P at the group's ranks, reduced and assembled, then Q' in the basis of
        that mean, reduced and assembled; the average is B Q'^T. A reduced part nobody could get is zeros alike
        on every member; a member whose mean differs from most of the group's takes theirs in phase 5."""
        group = result.group
        round_codec.use_ranks(result.ranks)
        sent, received = result.bytes_sent, result.bytes_received
        step: list[Assembled] = []
        for phase, mark in ((1, "transfer"), (2, "phase2")):
            message = round_codec.message(1) if phase == 1 else low_rank_second(round_codec, step[-1])
            self.clock.mark("encode")  # phase 2's too (its basis and factors): "phase2" is its exchange alone
            scattered = self.averager.scatter_phase(self.round, phase, message, group=group, group_id=result.group_id,
                                                    timeout=self.stage.deadlines.allreduce, clients=result.clients)  # fmt: skip
            for peer, reason in scattered.offenders.items():
                self.stage.strike(peer, f"round {self.round} phase {phase}: {reason}")
            assembled, reduced, more_sent, more_received = self._reduce_step(
                round_codec, message, scattered, group=group, clients=result.clients, group_id=result.group_id,
                phase=phase, marks=(mark, mark),
            )  # fmt: skip
            sent, received = sent + more_sent, received + more_received
            step.append(assembled)
        tensors = low_rank_average(round_codec, step[-1], reduced.energies)
        self.clock.mark("decode")
        used = tuple(group[i] for i in sorted(set(step[0].used) & set(step[1].used)))
        if not used:
            return self._none_averaged(len(group), expected)  # applies nothing: the buffer keeps the whole message
        holes = sum(len(s.refused) + s.empty for s in step)
        self._hold(tensors, AverageKind.AVERAGED, used, result.group_id)
        average = Average(kind=AverageKind.AVERAGED, tensors=tensors, group=used, bytes_sent=sent, bytes_received=received,
                          window=(self._window_start, time.time()), group_id=result.group_id,
                          note=f"{holes} reduced part(s) missing (zeros)" if holes else "",
                          digests=tuple(self._digests))  # fmt: skip
        self._log(average, expected=expected)
        return self._settled(round_codec, self._agree(average, voters=group), result.group_id,
                             lambda _: settle(round_codec, *step))  # fmt: skip

    def _reduce_step(
        self, round_codec: RoundCodec, message: bytes, scattered: Any, *, group: list[str], clients: Sequence[str],
        group_id: bytes, phase: int, marks: tuple[str, str],
    ) -> tuple[Assembled, Reduced, int, int]:  # fmt: skip
        """One step of the compressed butterfly once this worker holds the group's parts of its span of the `phase`
        messages (`scattered`: the step's RoundResult or a scatter_phase's GatherResult, whose offenders were struck):
        reduce them, all-gather the reduced parts, assemble; count what was left out, strike who served an altered
        reduced part, suspect members whose part never came. `marks`: the phase clock's names for the all-gather and
        for the assembly. Returns the assembly, this worker's reduce, and the bytes sent and received (the
        scatter's included). `clients`: the group's client members, which reduce no span (client_member.py)."""
        me = self.stage.peer_id
        reducers = reducers_of(group, clients)
        spans = part_spans(message, len(reducers))
        takers: list[str] = []  # client members whose parts came: they take this reducer's reduced part too
        if me in reducers:
            reduced = reduce(round_codec, scattered.messages, span=spans[reducers.index(me)], phase=phase,
                             reducers=len(reducers))  # fmt: skip
            self._left_out(group, reduced.rejected, what=f"phase-{phase} part")
            takers = [p for p, blob in zip(group, scattered.messages) if p in clients and blob is not None]
        else:  # a client member: its parts went to the reducers, it takes their reduced parts
            reduced = Reduced(b"", [])
        gathered = self.averager.gather_phase(self.round, reduced_phase(phase), reduced.blob, group=group, clients=clients,
                                              authors=reducers, takers=takers, group_id=group_id,
                                              timeout=self.stage.deadlines.allreduce)  # fmt: skip
        for peer, reason in gathered.offenders.items():
            self.stage.strike(peer, f"round {self.round} phase {phase} reduced parts: {reason}")
        self._digests.extend(d for d in gathered.digests if d is not None)
        self.clock.mark(marks[0])
        assembled = assemble(round_codec, gathered.messages, spans=spans, own=group.index(me), phase=phase,
                             group_size=len(group))  # fmt: skip
        self.clock.mark(marks[1])
        refused = {group.index(reducers[i]): why for i, why in assembled.refused.items()}  # by group index
        self._left_out(group, refused, what=f"phase-{phase} reduced part")
        for failure in [*scattered.failures, *gathered.failures]:
            logger.info("round %d: %s", self.round, failure)
        never = {**reduced.rejected, **refused}  # parts that never reached this reducer, reduced parts this member
        self._outsiders |= {*scattered.outsiders, *gathered.outsiders}
        self.membership.suspect(gather_suspects(group, never, self._outsiders, me=me), self.round)
        return (assembled, reduced, scattered.bytes_sent + gathered.bytes_sent,
                scattered.bytes_received + gathered.bytes_received)  # fmt: skip

    def _gathered(self, round_codec: RoundCodec, result: RoundResult, expected: int) -> Average:
        """Decode the group's all-gathered messages (after low-rank's second phase) to the average."""
        codec = round_codec.codec
        assert result.messages is not None
        messages, failures = result.messages, list(result.failures)
        sent, received = result.bytes_sent, result.bytes_received
        outsiders = set(result.outsiders)
        if codec.phases == 2:
            second = self.averager.gather_phase(
                self.round, 2, round_codec.message(2, messages), group=result.group, group_id=result.group_id,
                timeout=self.stage.deadlines.allreduce, clients=result.clients,
            )  # fmt: skip
            messages = second.messages
            sent, received = sent + second.bytes_sent, received + second.bytes_received
            failures += second.failures
            outsiders |= set(second.outsiders)
            for peer, reason in second.offenders.items():
                self.stage.strike(peer, f"round {self.round} phase 2: {reason}")
            self.clock.mark("phase2")
        decoded = round_codec.mean(messages)
        self.clock.mark("decode")
        used = tuple(result.group[i] for i in decoded.used)
        self._left_out(result.group, decoded.rejected, what="message")
        for failure in failures:
            logger.info("round %d: %s", self.round, failure)
        self.membership.suspect(gather_suspects(result.group, decoded.rejected, outsiders, me=self.stage.peer_id),
                                self.round)
        if not used:
            return self._none_averaged(len(result.group), expected)
        self._hold(decoded.tensors, AverageKind.AVERAGED, used, result.group_id)
        average = Average(
            kind=AverageKind.AVERAGED, tensors=decoded.tensors, group=used, bytes_sent=sent, bytes_received=received,
            window=(self._window_start, time.time()),
            group_id=result.group_id,
            note=f"{len(decoded.rejected)} of {len(result.group)} messages left out" if decoded.rejected else "",
        )  # fmt: skip
        self._log(average, expected=expected)
        agreed = self._agree(average, voters=result.group)  # the whole group votes, also members left out
        own = result.group.index(self.stage.peer_id)
        return self._settled(round_codec, agreed, result.group_id, lambda _: round_codec.settle_decoded(decoded, own))

    def _settle_taken(self, round_codec: RoundCodec, average: Average) -> None:
        """This worker applies `average`, not one it assembled (borrowed, or none: stranded): its message leaves the
        error-feedback buffer, whole, only if that average counted it."""
        round_codec.settle(average.kind.applies and self.stage.peer_id in average.group)

    def _left_out(self, group: Sequence[str], rejected: Mapping[int, str], *, what: str) -> None:
        """Count what was left out; strike the authors of what came intact (signed) and cannot be averaged."""
        for index, reason in rejected.items():
            self.stage.faults.count("messages_left_out", "round %d: %s's %s left out: %s",
                                    self.round, group[index], what, reason)  # fmt: skip
            if reason not in NO_FAULT:
                self.stage.strike(group[index], f"round {self.round}: its {what} {reason}")

    def _none_averaged(self, members: int, expected: int) -> Average:
        """Every message left out, on every member alike: no average (the mean of none is no zero step)."""
        note = f"all {members} messages of the group were left out"
        average = dataclasses.replace(applies_nothing(AverageKind.STRANDED, note, self._window_start), stranded_alike=True)
        self._log(average, expected=expected)
        return average
