"""One round's exchange of a stage worker (exchange_queue.py runs them in the background, one after another).

    Phase 1: wait (at most round_wait) until the stage's live members that take part in this round
             have started it (not for one still training an earlier round: membership.py)
    Phase 2: all-reduce with them (hivemind matchmaking, then the exact butterfly), or with
             compression, the compressed butterfly (compressed_round.py, compression/butterfly.py;
             low-rank rides it twice in the same group) or top-k's all-gather (gather.py)
    Phase 3: mend the spans that missed this worker from the group's other members, or,
             if the all-reduce failed, take the whole average from members that finished it
    Phase 4: suspect the members that failed, and say what happened: the Average's kind
    Phase 5: agree: the group's members compare the averages they hold (AverageRecords in the
             DHT) before any of them uses its own; one in the minority takes the majority's copy
             (vote.py)

A pseudo-gradient holding NaN or Inf is never sent: the round is dropped from this worker's
side (logged as an error, counted as `nonfinite_dropped`) and it takes its group's average.
What other members send is screened (allreduce.py, codec.py): a refused contribution or
message strikes its sender (stage.strike), and enough strikes ban it for the run.

A round never raises and never blocks past its timeouts: every way it can end is an
`AverageKind` (average.py), and STRANDED / ABANDONED apply nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import TimeoutError
from typing import TYPE_CHECKING, Any

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from .. import injection
from ..average import Average, AverageKind, Spans, applies_nothing
from .compressed_round import CompressedRound, gather_suspects, reduced_by_nobody
from .group_reuse import ReusedGroup, reused_group, whole_group
from .group_round import RoundResult
from .held import Collected, HeldAverage
from .matchmaking import cancel_step
from .phase_clock import PhaseClock
from .vote import GroupVote

if TYPE_CHECKING:
    from .stage import SwarmStage

__all__ = ["RoundExchange", "gather_suspects", "mending_order", "suspects_after"]

logger = logging.getLogger(__name__)

HOLD_END_S = 15.0  # fault injection `hold_exchange_end`: how late a member ends its exchange

COUNTED_OUT = "a leader counted this worker into a group after it had given up on the leader"
FOLLOWER_LAG_S = 2.5  # a follower of a designated leader declares this much later than the leader (_scheduled_time)
ALONE_WITH_OUTSIDERS = "every other member of its group had given up on this group's leader"
NOBODY_ELSE = "no other member of the stage group takes part in this round any more"
STEP_LOOK_EXTRA_S = 5.0  # hivemind's step looks for a group up to round_wait + this (its `timeout`)
STEP_GRACE_S = 10.0  # past its deadlines, how long a step may still take to report its end (_step_overdue)
STEP_LOST = "hivemind's step had not ended past its deadlines"
FLIPPED_SCALE = 4.0  # send_flipped_pseudo_gradient: a sign flip that no part of passes the norm screen's bar (10x)


def mending_order(result: RoundResult, me: str) -> list[str]:
    """Whom a member asks for the spans its all-reduce missed: the others of the group, those whose reducers
    delivered first (a "failed" one may be alive), never a member that was in no such group. Hivemind's leader
    can count in a follower that had already given up on it; that one looks for a group of its own, and asked
    for this round's average it waited out the request (10 s) for an average of another group."""
    failed, outsiders, clients = set(result.failed_reducers), set(result.outsiders), set(result.clients)
    others = [p for p in result.group if p != me and p not in outsiders]
    return sorted(others, key=lambda p: (p in clients, p in failed))  # a client member answers over its own links only


def suspects_after(result: RoundResult, answered: Iterable[str], *, mended: bool) -> list[str]:
    """The members of `result`'s group that failed in its all-reduce and gave no sign of life since: not
    expected in the next groups until they heartbeat again (membership.suspect). A reducer that answered
    the mending is alive (the failure was on the way to this worker only), with a copy or without one: one
    still waiting for its own average (not ready) or that failed too (lacking), suspected, was left out of the
    next round's group, so that the survivors of a crash each went alone or borrowed (CI run of b27b20d:
    a survivor took its partner for gone and averaged alone the round after); once nothing is missing
    (`mended`) every reducer delivered its part to someone. An outsider answered as well: it is in no such
    group (a leader counted it in after it had given up on the leader). Suspected, it was left out of the
    next rounds' expected count: a leader's target fell one short, the outsider filled the place first, and
    the member that place was meant for borrowed, round after round (busy run F7)."""
    alive = {*answered, *result.outsiders, *(result.failed_reducers if mended else ())}
    return [p for p in (*result.failed_reducers, *result.banned_senders) if p not in alive]


class RoundExchange(CompressedRound, GroupVote):
    """The exchange of one round's pseudo-gradient with the stage group."""

    def __init__(self, stage: SwarmStage, round: int, tensors: list[torch.Tensor], *, finite: bool = True):
        self.stage, self.round, self.tensors, self.finite = stage, round, tensors, finite
        self.sw, self.averager, self.membership = stage.sw, stage.averager, stage.membership
        self._control: Any = None  # hivemind's StepControl while the all-reduce runs
        self._expected: list[str] = []  # the other members this round's target counts (phase 1)
        self._started: list[str] = []  # ... those that had started the round when phase 1 ended
        self._clients: set[str] = set()  # ... those that average as client members (they never lead)
        self._gone: set[str] = set()  # members found gone while collecting: nothing listens at their addresses
        self._window_start = 0.0
        self._records: dict[str, Any] = {}  # the expected members' records as phase 1 ended (group_reuse.py)
        self._result: RoundResult | None = None  # what the last all-reduce of the round returned
        self._reused_id = b""  # the id of the round's group formed without matchmaking, if it was (group_reuse.py)
        self._overlooked = False  # fault injection overlook_joiner left a member out of this round's records
        self.clock = PhaseClock()

    def abandoned(self) -> bool:
        return self.round < self.stage.exchanges.abandon_below

    def cancel(self) -> None:
        control = self._control
        if control is not None:
            cancel_step(control)

    def run(self) -> Average:
        """The exchange, its seconds per phase in `Average.phases` and their ends in `Average.phase_ends`
        (phase_clock.py)."""
        average = self._run()
        if injection.armed("drop_average", round=self.round, stage=self.stage.stage):
            average = applies_nothing(AverageKind.STRANDED, "fault injection drop_average", self._window_start)
        if injection.armed("hold_exchange_end", round=self.round, stage=self.stage.stage):
            time.sleep(HOLD_END_S)
        self.stage.whole_group = whole_group(self.round, average, self._result)  # the next round may reuse it
        self.clock.mark("other")  # what no phase claimed
        reused = bool(self._reused_id) and average.group_id == self._reused_id
        return dataclasses.replace(average, phases=tuple(self.clock.seconds().items()),
                                   phase_ends=tuple(self.clock.ends().items()), group_reused=reused)  # fmt: skip

    def _run(self) -> Average:
        finite = self.finite  # stage.all_reduce looked (and told the others if not: MemberRecord.sitting_out)
        if not finite:
            self.stage.faults.count(
                "nonfinite_dropped",
                "round %d: this worker's pseudo-gradient holds NaN or Inf: it is not sent, and the group's average "
                "is taken instead (inner training may have diverged: check the loss and inner.lr)",
                self.round,
                level=logging.ERROR,
            )
        self._play_hostile()
        # Phase 1: wait until the stage's live members have started this round, or until one that has asks this
        # worker to lead its group (it waits for that in matchmaking: averager.asked_to_lead). On 2 busy cores a
        # designated leader still waiting for a frozen member it took for late kept its follower's request 4 s and
        # refused it, and the follower's matchmaking ran out (test_elastic, busy run of 3911798)
        others = self.membership.wait_for_round(self.round, self.sw.round_wait, give_up=self._stop_waiting)
        self.clock.mark("wait")
        self._expected = [m.peer_id for m in others]
        self._records = {m.peer_id: m.record for m in others}
        self._started = [m.peer_id for m in others if m.record.averaging_round >= self.round]
        self._clients = {m.peer_id for m in others if m.record.client}
        late = sorted(set(self._expected) - set(self._started))
        if late and self.averager.asked_to_lead(self.round):
            logger.info("round %d: a member waits for this worker to lead its group: no longer waiting for %s to start "
                        "the round", self.round, ", ".join(p[-8:] for p in late))  # fmt: skip
        if self.abandoned():
            return applies_nothing(AverageKind.ABANDONED, "this peer moved on to the swarm's state", self._window_start)
        if not others:
            if not finite:
                return applies_nothing(AverageKind.STRANDED, "a non-finite pseudo-gradient and nobody to average with", 0.0)
            return self._alone()
        self._window_start = time.time()
        if finite and all(self.membership.finished(m, self.round) for m in others):
            # a round behind (it took a state the others had left, or thawed): nobody will group for this round any
            # more. Borrowing at once, not after matchmaking gave up (round_wait / 4), it reaches the others' round
            # while they still wait for it (they wait for a member that started the round before theirs)
            average = self._borrow("the stage group averaged without this worker")
            self._log(average, expected=1 + len(others))
            return self._agree(average)
        if not finite:  # the others average without it (matchmaking waits up to round_wait for it first)
            return self._agree(self._borrow("this worker's pseudo-gradient was not finite",
                                            wait_s=self.sw.round_wait + self.stage.deadlines.allreduce))
        # Phase 2: all-reduce with them
        if self.stage.codec_for(self.round) is not None:
            return self._compressed(expected=1 + len(others))
        result, failure = self._grouped(expected=1 + len(others))
        if self.abandoned():
            return applies_nothing(AverageKind.ABANDONED, "this peer moved on to the swarm's state", self._window_start)
        # Phase 3: mend what missed this worker, or borrow the group's average
        if result is not None:
            average = self._mend(result)
        elif failure == NOBODY_ELSE:  # still looking for a group: nobody took its part, nobody has an average
            logger.info("round %d: %s: this worker applies its own pseudo-gradient", self.round, failure)
            return self._alone()
        else:
            average = self._borrow(failure)
        # Phase 4: say what happened
        self._log(average, expected=1 + len(others))
        # Phase 5: agree with the group on one average
        return self._agree(average)

    def _stop_waiting(self) -> bool:
        return self.abandoned() or self.averager.asked_to_lead(self.round)

    def _alone(self) -> Average:
        """Nobody else takes part in this round: the worker's own pseudo-gradient is the round's average, served
        like any average (a member that arrives late, or a restarted one that took this worker's state with its
        pending average to follow, borrows it and stays in agreement)."""
        self._hold(self.tensors, AverageKind.ALONE, (self.stage.peer_id,), b"")
        return Average(kind=AverageKind.ALONE, tensors=self.tensors)

    def _play_hostile(self) -> None:
        """Fault injection: send what this worker's own checks would have kept back (docs/security.md)."""
        where = dict(round=self.round, stage=self.stage.stage)
        if injection.armed("send_nan_pseudo_gradient", **where):
            self.tensors = [torch.full_like(t, float("nan")) for t in self.tensors]
        elif injection.armed("send_huge_pseudo_gradient", **where):
            self.tensors = [t * 1000 for t in self.tensors]
        elif injection.armed("send_flipped_pseudo_gradient", quiet=True, **where):
            self.tensors = [t * -FLIPPED_SCALE for t in self.tensors]

    # ----- phase 2 -------------------------------------------------------------------------
    def _grouped(
        self, expected: int, payload: bytes | None = None, ranks: Sequence[int] = ()
    ) -> tuple[RoundResult | None, str]:
        """All-reduce with the stage group, and once more where matchmaking split asymmetrically: a leader counted
        in a follower that had given up on it, so that the follower holds no group and the leader a group of
        outsiders only. In a pair both ended without an average (stranded, seen in a shaped 2-peer swarm in CI);
        looking again, they find each other. The follower learns it at once (the leader's parts reach it), the
        leader only when the follower answers them, which may take the matchmaking's request_timeout and a second
        (the follower first waits for its own join requests in flight: group_admission._outside_group). Where the others
        did average, the worker borrows their average as before. A compressed round (`payload`, `ranks`) looks
        again the same way: without it, a pair split so in its first round stranded both (CI, test_trust)."""
        reused = self._reused()
        result, failure = self._all_reduce(expected, payload, ranks, leader=self._leader(), reused=reused)
        if result is None and failure in (COUNTED_OUT, ALONE_WITH_OUTSIDERS) and self._may_regroup(reused):
            logger.info("round %d: %s; looking for a group once more", self.round, failure)
            result, failure = self._all_reduce(expected, payload, ranks)  # hivemind's search alone
        return result, failure

    def _reused(self) -> ReusedGroup | None:
        """The last round's group, formed again without matchmaking where its members all started this round with a
        ticket in their records (group_reuse.py); None: matchmaking. A worker armed with a follower's fault injection
        uses matchmaking (the fault is in it)."""
        if self._follows_by_fault() or self.stage.client:
            return None
        records, last = self._records, self.stage.whole_group
        if last is not None and set(records) - set(last.members) and injection.armed(
                "overlook_joiner", round=self.round, stage=self.stage.stage):  # fmt: skip
            records = {p: r for p, r in records.items() if p in last.members}
            self._overlooked = True
        group, why = reused_group(run_id=self.stage.cfg.run.run_id, stage=self.stage.stage, round=self.round,
                                  me=self.stage.peer_id, mine=self.stage.tickets.get(self.round), last=last,
                                  records=records)  # fmt: skip
        if group is not None and injection.armed("skip_group_reuse", round=self.round, stage=self.stage.stage):
            return None
        if group is None:
            logger.debug("round %d: matchmaking: %s", self.round, why)
        return group

    def _leader(self) -> str:
        """The member this round's group forms around (matchmaking.DesignatedLeader): the smallest peer id of the
        members this worker expects that had started the round (one still training it, or frozen, would keep its
        followers waiting for it to look), itself included. A worker armed with fault injection `abandon_accepted`
        or `lose_begin` names none: the fault is a follower's. Client members lead no group (nobody could reach them
        to join it): none of them is named, and where every member is one, nobody is (no group forms)."""
        if self._follows_by_fault():
            return ""
        me = [] if self.stage.client else [self.stage.peer_id]
        leader = min([*me, *(p for p in self._started if p not in self._clients)], default="")
        if not leader and self.stage.client and set(self._expected) <= self._clients and not self.stage.said_no_reducer:
            self.stage.said_no_reducer = True
            logger.warning("round %d: every member of this stage is a client member: nobody can reduce, so no group forms "
                           "(each round waits out round_wait); a peer the swarm can dial, or a forwarded port here, "
                           "lets them average", self.round)  # fmt: skip
        return leader

    def _may_regroup(self, reused: ReusedGroup | None) -> bool:
        # while the round's wait lasts: the follower looks again at once and waits round_wait for a group, so the
        # leader that learns of the split up to request_timeout + 1 s later still finds it looking (a limit of
        # round_wait / 2 let the leader of a pair at round_wait 10 give up, and the pair stranded: CI, test_peer_control).
        # Not asked whether the others finished the round: at that moment a member's record may say so before its
        # average is in (seen in CI: the leader borrowed from the follower that was looking again, and both
        # stranded); a look that finds nobody gives up as soon as a member did finish (_wait_for_step), and borrows
        if self.abandoned() or time.time() - self._window_start >= self.sw.round_wait:
            return False
        return not (reused and self._overlooked and injection.armed("skip_regroup", round=self.round, stage=self.stage.stage))

    def _all_reduce(
        self, expected: int, payload: bytes | None = None, ranks: Sequence[int] = (), *, leader: str = "",
        reused: ReusedGroup | None = None,
    ) -> tuple[RoundResult | None, str]:
        if payload is None:
            with self.averager.get_tensors() as buffers:
                for buf, t in zip(self._buffers(buffers), self.tensors, strict=True):
                    buf.copy_(t)
        ticket = self.averager.prepare_round(
            self.round, expected, payload=payload,
            admitted=sorted(self.membership.voters()), banned=sorted(self.membership.banned()),
            banned_keys=sorted(self.membership.banned_keys()), expected=self._expected,
            ranks=ranks, leader=leader, client=bool(self.stage.client), reused=reused,
        )  # fmt: skip
        if reused is not None:  # the ticket in this worker's record, and so in the group's gathered data
            ticket, self._reused_id = reused.ticket, reused.group_id
        started = time.monotonic()
        self._control = self.averager.step(
            gather=ticket, timeout=self.sw.round_wait + STEP_LOOK_EXTRA_S, allow_retries=True, wait=False,
            scheduled_time=self._scheduled_time(follows=bool(leader) and leader != self.stage.peer_id),
        )  # fmt: skip
        try:
            result, gave_up = self._wait_for_step(started, expected)
            self._result = result
            self.clock.mark_split("matchmaking", "transfer", at=result.grouped_at if result is not None else None)
            if injection.armed("kill_peer_in_allreduce", round=self.round, stage=self.stage.stage):
                # no other member's part reached this worker (it would have died on the first): the group went on
                # without its data, or formed after it had given up; it dies before it takes any average
                injection.kill_peer("kill_peer_in_allreduce: the all-reduce ended before a part reached it")
            if result is not None:
                for peer, reason in result.offenders.items():
                    self.stage.strike(peer, f"round {self.round}: {reason}")
                if result.alone_with_outsiders(self.stage.peer_id):
                    return None, ALONE_WITH_OUTSIDERS
            return result, gave_up
        except BaseException as e:  # includes the CancelledError of an abandoned round
            return None, f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            self._control = None

    def _scheduled_time(self, *, follows: bool) -> float | None:
        """When this worker's group is to begin (hivemind's default: now + min_matchmaking_time = round_wait). A
        worker that `follows` a designated leader declares FOLLOWER_LAG_S later, so that the leader (which
        declares the default) takes its request though it looked a moment before the leader did. A worker armed
        with fault injection `abandon_accepted` declares later still, so that it follows a leader rather than
        leads: the fault is a follower's (as a leader it never meets it, and a run where it led every armed round
        tested nothing: seen once in 10 runs on 2 loaded cores)."""
        if self._follows_by_fault():
            return get_dht_time() + self.sw.round_wait + 2 * FOLLOWER_LAG_S
        return get_dht_time() + self.sw.round_wait + FOLLOWER_LAG_S if follows else None

    def _follows_by_fault(self) -> bool:
        """Fault injection `abandon_accepted` or `lose_begin` is armed for this round: both are a follower's."""
        return bool(injection.first_armed(injection.FOLLOWER_FAULTS, round=self.round, stage=self.stage.stage))

    def _wait_for_step(self, started: float, target: int) -> tuple[RoundResult | None, str]:
        """Wait for hivemind's step; while still matchmaking, give up early once a member of the stage has
        finished this round's all-reduce without us (its group formed and is done), or once no other member
        takes part in the round any more (NOBODY_ELSE: the others left, or the one this worker waited for
        restarted and is joining again or took a later state: its new heartbeat says so long before the step's
        deadline; the worker then goes alone). When fewer members than `target` still
        train, the target is lowered: a leader holding them all starts the group instead of waiting out
        round_wait for a member that left (matchmaking.lower_target). And at once when a leader counted this
        worker into a group after it had given up on the leader: its members asked it for its part (it borrows
        their average). A member that is gone (killed: its record still says it trains) is found by a probe
        and left out of the target too (membership.drop_gone). A step past all its deadlines is cancelled
        (`_step_overdue`: STEP_LOST). Returns (the result, why there is none)."""
        probed = False
        while True:
            try:
                return self._control.result(timeout=1.0), ""
            except TimeoutError:
                pass
            if self._step_overdue(started):
                cancel_step(self._control)
                self.stage.faults.count(
                    "steps_lost", "round %d: hivemind's averaging step had not ended %.0f s after it began (%s), past "
                    "its deadlines: cancelled, and this worker takes its group's average instead", self.round,
                    time.monotonic() - started, self._control.stage.name, level=logging.ERROR,
                )  # fmt: skip
                return None, STEP_LOST
            if self._control.stage != AveragingStage.LOOKING_FOR_GROUP:
                continue
            if self.averager.counted_out(self.round):  # the others average without it, in a group it never joined
                cancel_step(self._control)
                return None, COUNTED_OUT
            if time.monotonic() - started < self.sw.round_wait / 4:
                continue
            if not self.membership.refresh():
                continue  # a failed lookup says nothing about who trains
            others = self.membership.members(training_only=True)
            if not probed:  # a member killed in the round left a record that still says it trains
                probed = True
                if self.membership.drop_gone([m.peer_id for m in others], self.round):
                    others = self.membership.members(training_only=True)
            # one that took a later state meanwhile (a restarted peer that caught up: first_round) never comes,
            # and its record's boundary says nothing of this round's groups (CI: a survivor took the restarted
            # peer for a member, waited out the step, 15 s, and stranded the round with it)
            others = [m for m in others if self.membership.takes_part(m, self.round)]
            if any(self.membership.finished(m, self.round) for m in others):
                cancel_step(self._control)
                return None, "the stage group averaged without this worker"
            if not others:
                cancel_step(self._control)
                return None, NOBODY_ELSE
            if 1 + len(others) < target:
                target = 1 + len(others)
                started_now = self.averager.lower_target(self.round, target)
                logger.info("round %d: %d member(s) still train: the group's target is now %d%s", self.round,
                            len(others), target, " and this worker's group starts now" if started_now else "")

    def _step_overdue(self, started: float) -> bool:
        """Whether hivemind's step, begun at `started`, ran past every deadline it has by STEP_GRACE_S: its search
        (round_wait + STEP_LOOK_EXTRA_S: a step whose all-reduce failed looks again while that lasts, so the end of
        one all-reduce bounds nothing) and then one all-reduce (the stage's deadline). Its end never came (a result
        its MPFuture lost, an averager process stuck): without this, the exchange thread would wait for it forever,
        and the peer with it. (Cutting a step 10 s after its all-reduce began, once, stranded a slow pair's round
        that hivemind was retrying: CI run 218, test_learned_deadlines.)"""
        allreduce = self.stage.deadlines.allreduce
        return time.monotonic() - started > self.sw.round_wait + STEP_LOOK_EXTRA_S + allreduce + STEP_GRACE_S

    def _hold(
        self, tensors: list[torch.Tensor], kind: AverageKind, group: tuple[str, ...], group_id: bytes, missing: Spans = (),
        counted_by: tuple[tuple[str, ...] | None, ...] = (),
    ) -> None:  # fmt: skip
        """Keep `tensors` as this round's average, served to members that ask for it. The buffers' lock is held
        until the averager has its copy: an all-reduce of a step cancelled after its group formed still runs (it
        writes its output into the buffers at its end, and waits for the lock to start), and it must not overwrite
        them in between."""
        with self.averager.get_tensors() as buffers:
            for buf, t in zip(self._buffers(buffers), tensors, strict=True):
                buf.copy_(t)
            self.averager.hold_buffers(self.round, kind, group, group_id, missing, counted_by)

    def _buffers(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """The averager's buffers of the tensors this round averages (a streaming fragment's, or all)."""
        return [buffers[i] for i in self.stage.fragment_indices(self.round)]

    # ----- phase 3 -------------------------------------------------------------------------
    def _mend(
        self, result: RoundResult, tensors: list[torch.Tensor] | None = None,
        counted_by: tuple[tuple[str, ...] | None, ...] = (),
    ) -> Average:  # fmt: skip
        """Fill the spans of `result` that missed this worker from the group's other members (`tensors`: the
        average with those holes; None: the averager's buffers, where the fp32 butterfly left it; `counted_by`:
        the compressed butterfly's, per reducer, filled in from the copies that fill its spans)."""
        if tensors is None:
            with self.averager.get_tensors() as buffers:
                tensors = [b.clone() for b in self._buffers(buffers)]
        kind = AverageKind.PARTIAL if result.missing else AverageKind.AVERAGED
        raw = HeldAverage(self.round, kind, tensors, result.missing, tuple(result.group), result.group_id, counted_by)
        bytes_received = result.bytes_received
        answered: list[str] = []
        mended_from: list[str] = []
        skip = injection.armed("skip_mending", round=self.round, stage=self.stage.stage)
        if result.missing and not skip and not reduced_by_nobody(result.failed_reducers, result.outsiders):
            collected = self._collect(mending_order(result, self.stage.peer_id), start=raw)
            if collected.elsewhere and result.alone_with_outsiders(self.stage.peer_id, collected.elsewhere):
                return self._borrow(f"the others of its group ({', '.join(p[-8:] for p in collected.elsewhere)}) "
                                    "averaged the round in another group")  # fmt: skip
            raw, mended_from = collected.average or raw, collected.mended_from
            answered = collected.alive
            bytes_received += collected.bytes_received
        self.membership.suspect(suspects_after(result, answered, mended=not raw.missing), self.round)
        self.clock.mark("mend")
        return raw.to_average(
            bytes_sent=result.bytes_sent,
            bytes_received=bytes_received,
            window=(self._window_start, time.time()),
            mended_from=tuple(mended_from),
            digests=tuple(result.digests),  # the fp32 butterfly's reducers' (the compressed one's: its own caller's)
        )

    def _borrow(self, failure: str, wait_s: float | None = None) -> Average:
        self.averager.mark_failed(self.round)
        self.membership.refresh()
        members = self.membership.members(training_only=True)
        # client members last: one answers only where it holds a connection to this worker (it opened it)
        order = [m.peer_id for m in sorted(members, key=lambda m: (m.record.client, not self.membership.finished(m, self.round)))]
        collected = self._collect(order, start=None, wait_s=wait_s)
        self.clock.mark("borrow")
        if collected.average is None:
            note = f"this worker's all-reduce failed ({failure}) and no member had the group's average"
            # members that answered all lack it too: the group is stranded alike, nobody is ahead
            alike = bool(collected.lacking) and all(f.split(":")[0] in collected.lacking or "STATE_" not in f
                                                    for f in collected.failures)  # fmt: skip
            return dataclasses.replace(applies_nothing(AverageKind.STRANDED, note, self._window_start), stranded_alike=alike)
        return collected.average.to_average(
            bytes_received=collected.bytes_received,
            window=(self._window_start, time.time()),
            note=f"this worker's all-reduce failed ({failure})",
            mended_from=tuple(collected.mended_from),
        )

    def _collect(self, peers: list[str], *, start: HeldAverage | None, wait_s: float | None = None) -> Collected:
        wait_s = wait_s or self.stage.deadlines.chunk
        collected = self.averager.collect(
            self.round, peers, start=start, wait_s=wait_s, deadline_s=max(self.stage.deadlines.state, wait_s)
        )
        for failure in collected.failures:
            self.stage.faults.count("downloads_failed", "round %d: no average from %s", self.round, failure)
        self._gone.update(collected.gone)
        return collected

    # ----- phase 4 -------------------------------------------------------------------------
    def _log(self, average: Average, expected: int) -> None:
        share = f"{100 * average.coverage:.1f}% of coordinates"
        if average.kind is AverageKind.AVERAGED:
            logger.info("round %d averaged in a group of %d (expected %d)", self.round, average.group_size, expected)
        elif average.kind is AverageKind.MENDED:
            logger.warning("round %d: parts that missed this worker were taken from %s; %s averaged",
                           self.round, ", ".join(average.mended_from), share)
        elif average.kind is AverageKind.PARTIAL:
            taken = ", ".join(average.mended_from)
            mended = f" (parts that missed this worker taken from {taken})" if taken else ""
            logger.warning("round %d: reducers failed before any member got their parts; %s averaged%s, "
                           "the rest left unchanged on every member", self.round, share, mended)
        elif average.kind is AverageKind.BORROWED:
            logger.warning("round %d: %s; took the average of its group of %d from %s (%s)",
                           self.round, average.note, average.group_size, ", ".join(average.mended_from), share)
        else:
            logger.warning("round %d: %s: %s", self.round, average.kind.value, average.note)
