"""hivemind's DecentralizedAverager, extended for DiLoCoX stage groups.

Runs in its own process (hivemind's), beside the stage worker. What it adds:
1. Exact, round-keyed all-reduce (allreduce.py): the group bits spell the round, the
   target group size is set per round from the stage's live members, and every member
   receives the same bits.
2. Each round's average is kept and served to the group's other members, who mend their copy
   from it or borrow it (held.py: AverageService).
3. A joining or repairing worker downloads the stage's state at a round boundary (theta_g,
   momentum, pending average) from a live worker (state_service.py: StateService).
4. With compression, the round's group exchanges compressed messages instead of running the
   fp32 butterfly (group_round.py: the compressed butterfly, or an all-gather for top-k with
   compression.topk_transport = "gather"; gather.py).
5. Trust (envelope.py, docs/security.md): requests and replies are signed (transfer.py:
   SignedReplies). Matchmaking carries a signed GroupTicket in hivemind's JoinRequest.gather:
   a leader takes only members with a valid ticket that this round admits (live, not banned),
   a follower asks only such leaders, and a member whose group holds any other leaves it.
6. The stage's other members push their member records when they change; the stage worker
   takes them from `pushed_records` (member_push.py).

The private hivemind methods overridden here are listed in hivemind_patches.py.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture

from .. import injection
from ..average import AverageKind, Spans
from ..compression.lowrank import agreed_ranks
from ..envelope import Gate, Signer
from ..fragments import as_fragments, of_round
from ..proto_gen import envelope_pb2
from ..wire import swarm_pb2
from .faults import RefusalLog
from .client_member import reach_members
from .deadlines import SharedDeadlines
from .gather import Arrivals, GatherResult, MessageGather
from .group_admission import GroupAdmission, ask_designated_then_admitted
from .group_reuse import REUSE_ID_BYTES, ReusedGroup, reuse_group_id
from .group_round import GroupRound, RoundResult
from .held import AverageService, Collected, HeldAverage
from .matchmaking import (
    DesignatedLeader,
    abandon_begun_groups,
    drop_stale_searches,
    forget_lost_acceptance,
    hold_matchmaking_tasks,
    lower_target,
    screen_join_requests,
    set_target_size,
    space_queue_reads,
    track_join_requests,
)
from .member_push import MemberPushes
from .priority import lower_priority
from .state_pieces import StatePieces
from .state_service import StateDownload, StateProvider, StateService
from .transfer import SignedReplies

__all__ = ["DilocoxAverager", "round_group_bits"]

logger = logging.getLogger(__name__)

ROUND_BITS = 24
ALIVE_CHECK_S = 1.0  # a call into the averager process checks that the process lives this often
OUTSIDE_GROUPS_KEPT = 16  # the latest groups found counted out, answered at once (_outside_group)
LEAD_SHARE = 0.25  # of round_wait: a designated leader waits this long for its followers before it searches too


def round_group_bits(round: int) -> str:
    """Group-key bits that spell the round number (groups never mix rounds)."""
    return format(round % (1 << ROUND_BITS), f"0{ROUND_BITS}b")


async def _keep_group_key(*args: Any, **kwargs: Any) -> None:
    """Replaces hivemind's group-key rotation (the bits are set per round). hivemind 1.1.10 passes
    `is_leader=`, 1.1.11-1.1.12 only the group info: accept both."""
    return None


class DilocoxAverager(
    GroupAdmission, GroupRound, AverageService, StateService, StatePieces, SignedReplies, MessageGather, MemberPushes,
    SharedDeadlines, DecentralizedAverager,
):
    """One stage worker's averager: exact round-keyed all-reduce, average and state serving."""

    _rpc_handlers = None  # hivemind caches RPC handlers per class: collect this subclass's own
    _stub_type = None

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any,
        *,
        run_id: str,
        config_hash: str,
        stage: int,
        nice: int = 0,
        max_message_bytes: int = 0,
        signer: Signer,
        gate: Gate,
        max_norm_ratio: float = 10.0,
        clip_ratio: float = 0.0,
        direction_screen: bool = False,
        fragments: Sequence[Sequence[int]] | None = None,
        **kwargs: Any,
    ):
        self.run_id, self.config_hash, self.stage, self.nice = run_id, config_hash, stage, nice
        # streaming: round r averages the tensors of fragment fragment_of(r, P) only (fragments.py)
        self.fragments = as_fragments(fragments, len(averaged_tensors))
        self.signer, self.gate, self.max_norm_ratio, self.clip_ratio = signer, gate, max_norm_ratio, clip_ratio
        self.direction_screen = direction_screen
        self._admitted: frozenset[str] = frozenset()  # this round's admissible group members (prepare_round)
        self._expected: frozenset[str] | None = None  # the members this round's target counts (None: any member)
        self._extras: set[str] = set()  # followers accepted this round that the target did not count
        self._refusals = RefusalLog()
        self._refused_total = mp.Value(ctypes.c_int64, 0)  # read by the host for the requests_refused count
        self._boundary = mp.Value(ctypes.c_int64, -1)
        self._state_ready = mp.Value(ctypes.c_bool, False)
        self._kept_boundary = mp.Value(ctypes.c_int64, -1)  # a complete earlier state kept for a joiner
        self._state_wanted = mp.Value(ctypes.c_int64, 0)  # state downloads waiting in the averager process
        self._pending_owed = mp.Value(ctypes.c_int64, -1)  # a boundary served without its pending average (STATE_NOW)
        self._pending_owed_until = mp.Value(ctypes.c_double, 0.0)  # ... whose taker may ask for it until (time.time())
        self._state_asked = mp.Value(ctypes.c_int64, -1)  # the boundary a state fetch from the host is for
        self._state_now = mp.Value(ctypes.c_bool, False)  # ... and whether it may leave out an average in flight
        self._state_fetch: asyncio.Lock | None = None  # one fetch at a time (averager process): _state_asked is shared
        self._failed_round = mp.Value(ctypes.c_int64, -1)  # the latest round whose exchange failed here
        self._life_start = mp.Value(ctypes.c_int64, -1)  # the boundary this process started from (set_life_start)
        self._earlier_exchange = mp.Value(ctypes.c_int64, -1)  # the last exchange its earlier life began (same)
        self._counted_out = mp.Value(ctypes.c_int64, -1)  # the latest round a group it never learnt of held it
        self._asked_to_lead = mp.Value(ctypes.c_int64, -1)  # the latest round a member asked it to lead before it looked
        # the groups this worker found itself counted into without joining them (averager process, _outside_group)
        self._outside_groups: collections.deque[bytes] = collections.deque(maxlen=OUTSIDE_GROUPS_KEPT)
        self._begun: collections.OrderedDict[bytes, GroupInfo] = collections.OrderedDict()  # group_admission.py
        self._joins_begun: dict[bytes, asyncio.Task] = {}
        self._grouped_at: float | None = None  # when the group of the all-reduce running now formed (unix time)
        self._grouped_round = -1  # ... and its round
        self._state_provider: StateProvider | None = None
        self._current_round = -1
        self._held: dict[int, HeldAverage] = {}
        self._dropped_up_to = -1  # the latest round whose average was held here and dropped (KEEP_AVERAGES)
        self._held_arrived = Arrivals()  # an average was held: wakes the requests waiting for it (held.py)
        self._last_result: RoundResult | None = None
        self._payload: bytes | None = None  # this round's compressed message (phase 1), if compressed; b"": later
        self._group_ranks: list[int] = []  # low-rank: the ranks most tickets of the group formed now name
        self._group_clients: frozenset[str] = frozenset()  # the client members of the group formed now (tickets)
        self._designated = DesignatedLeader()  # the member this round's group forms around (matchmaking.py)
        self._reuse_armed: tuple[int, GroupInfo] | None = None  # this round's group without matchmaking (group_reuse.py)
        self._reuse_next: tuple[int, bytes] = (-1, b"")  # the next round's group id, were this round's group reused
        self._reuse_hint = mp.Array(ctypes.c_char, REUSE_ID_BYTES)  # ... as the host saw the members (expect_group)
        self._reuse_hint_round = mp.Value(ctypes.c_int64, -1)
        # messages go to the averager process through shared memory: hivemind's command pipe is
        # non-blocking on the averager's side and breaks on anything larger than its buffer
        self._outbox = torch.zeros(max_message_bytes, dtype=torch.uint8).share_memory_()
        self._init_gather(max_message_bytes)
        self._init_pushes()
        self._init_deadlines(kwargs.get("allreduce_timeout"), kwargs.get("next_chunk_timeout"))
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self) -> None:
        lower_priority(self.nice)  # see priority.py: the exchange takes the CPU training leaves idle
        super().run()

    # ----- host side --------------------------------------------------------------------
    def set_state_provider(self, provider: StateProvider) -> None:
        self._state_provider = provider

    def set_state_boundary(self, boundary: int, ready: bool) -> None:
        """Tell the averager process which boundary this worker's state is at (and if complete)."""
        with self._boundary.get_lock():
            self._boundary.value = boundary
            self._state_ready.value = ready

    def set_life_start(self, boundary: int, earlier_exchange: int = -1) -> None:
        """This worker's process started from `boundary` (its checkpoint's, 0 if new): it holds no average of an
        earlier round, and says so at once to a member of that round's group that asks (RESTARTED). Nor of the
        rounds up to `earlier_exchange` (the last exchange its earlier life began, as that life's member record
        said) until it begins one of them itself: a member that asks was in a group of the earlier life."""
        self._earlier_exchange.value = earlier_exchange
        self._life_start.value = boundary

    def mark_failed(self, round: int) -> None:
        """This worker's own exchange of `round` failed: members asking for its average are told at once
        that it lacks one too (so that members all stranded alike know it and need not resync)."""
        self._failed_round.value = round

    def expect_group(self, round: int, group_id: bytes) -> None:
        """The group `group_id` is the one round `round` forms without matchmaking where the members this worker sees as
        it starts the round are its last round's whole group (group_reuse.py): a part of it that reaches this worker
        before its exchange of the round begins waits for it, and one that reaches it while it looks for a group
        through matchmaking makes it join late. It tells the averager process without a call (shared memory)."""
        with self._reuse_hint.get_lock():
            self._reuse_hint.raw = group_id
            self._reuse_hint_round.value = round

    def _reuse_round(self, group_id: bytes) -> int | None:
        """The round whose group formed without matchmaking `group_id` may be, as this worker's last group or the host's
        view of the members named it (None: neither)."""
        if group_id == self._reuse_next[1]:
            return self._reuse_next[0]
        with self._reuse_hint.get_lock():
            hinted, round = self._reuse_hint.raw, self._reuse_hint_round.value
        return round if round >= 0 and group_id == hinted else None

    def counted_out(self, round: int) -> bool:
        """A member of a group of round `round` asked this worker for its part or message while this worker
        looked for a group: a leader counted it in after it had given up on the leader (matchmaking.py). That
        group averages without it; looking on for another finds nobody (the others are in it)."""
        return self._counted_out.value == round

    def asked_to_lead(self, round: int) -> bool:
        """A member asked this worker to lead the group of round `round` (or a later one) before this worker looked
        for it (group_admission._wait_to_lead): that member is in matchmaking already and waits for this one."""
        return self._asked_to_lead.value >= round

    def refused_total(self) -> int:
        """Requests and join requests refused by the averager process so far."""
        return self._refused_total.value

    def state_wanted(self, boundary: int | None = None, *, owed_only: bool = False) -> bool:
        """Whether a peer is waiting to download this worker's state (not asked if `owed_only`), or (`boundary`) will
        ask for the pending average of that boundary's state it took without it, or for more of its pieces
        (StateService._owe_pending): a complete state of it should be kept past the boundary. A taker asks for that
        average only after it installed the state (its stages agree first), and a donor faster than that moved on
        meanwhile: the taker, stranded, took the state again."""
        if self._state_wanted.value > 0 and not owed_only:
            return True
        return boundary is not None and self._pending_owed.value == boundary and time.time() < self._pending_owed_until.value

    def set_kept_boundary(self, boundary: int) -> None:
        """Tell the averager process that the complete state of `boundary` is kept (-1: none)."""
        self._kept_boundary.value = boundary

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], None]:
        """Runs in the host process when a peer downloads state: a consistent copy of the complete state of
        the boundary asked for (`_fetch_state`), or {"boundary": -1} if this worker holds none."""
        asked, now = self._state_asked.value, self._state_now.value
        state = self._state_provider(asked, now) if self._state_provider is not None else None
        if state is None:
            return {"boundary": -1}, [], None
        metadata: dict[str, Any] = {
            "boundary": state.boundary, "state_hash": state.hash(), "pending": None, "follows": state.follows
        }  # fmt: skip
        if state.pending is not None:
            average = state.pending.average
            metadata["pending"] = {
                "round": state.pending.round,
                "kind": average.kind.value,
                "missing": [list(s) for s in average.missing],
                "group": list(average.group),
            }
        return metadata, state.tensors(), None

    def _of_round(self, round: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Those of `tensors` (one per stage tensor) that round `round` averages."""
        return [tensors[i] for i in of_round(self.fragments, round)]

    def _call(self, method: str, result_within: float, **kwargs: Any) -> Any:
        """Run `method` in the averager process; its result (or exception) within `result_within` seconds, or
        AllreduceException at once if the averager process died (a signal sent to the whole process group):
        a stopping worker must not wait out the call's whole time for it."""
        future = MPFuture()
        self._outer_pipe.send((method, [], dict(kwargs, future=future)))
        deadline = time.monotonic() + result_within
        while True:
            try:
                return future.result(timeout=max(0.0, min(ALIVE_CHECK_S, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if not self.is_alive():
                    raise AllreduceException(f"{method}: this worker's averager process has died") from None

    def prepare_round(
        self,
        round: int,
        target_group_size: int,
        payload: bytes | None = None,
        *,
        admitted: Sequence[str] = (),
        banned: Sequence[str] = (),
        banned_keys: Sequence[bytes] = (),
        expected: Sequence[str] | None = None,
        ranks: Sequence[int] = (),
        leader: str = "",
        client: bool = False,
        reused: ReusedGroup | None = None,
    ) -> bytes:
        """Set up the next step: its round, target group size, the workers it may group with (`admitted`,
        besides this one) and those banned, and with compression this worker's phase-1 message (the step
        then exchanges messages instead of running the butterfly; b"": the step only forms the group, and the
        worker sends its messages once it knows the group's ranks: low-rank, `scatter_phase`). `expected`: the
        other workers the target counts; a follower outside them raises the target by one as it joins
        (matchmaking.screen_join_requests). `ranks`: low-rank's ranks this worker would use, in its ticket.
        `leader`: the member the group forms around ("" none: hivemind's search alone; matchmaking.py). `client`:
        this worker averages as a client member (it reduces no span, leads no group: hivemind's client mode for
        matchmaking), as its ticket says. `reused`: the round's group formed without matchmaking (group_reuse.py),
        which the step takes instead of looking for one.
        Returns the signed GroupTicket to pass to `step(gather=...)`."""
        size = self._stage(payload) if payload is not None else -1
        kwargs = dict(round=round, target=target_group_size, payload_size=size, admitted=list(admitted), banned=list(banned),
                      banned_keys=list(banned_keys), expected=None if expected is None else list(expected),
                      leader=leader, client=client, reused=reused)  # fmt: skip
        self._call("_prepare_round", 30.0, **kwargs)
        return self.seal_ticket(round, ranks, client=client)

    def seal_ticket(self, round: int, ranks: Sequence[int], *, client: bool) -> bytes:
        """This worker's signed GroupTicket for round `round` (group_admission.py)."""
        ticket = envelope_pb2.GroupTicket(schema=self.schema_hash, ranks=list(ranks), client=client)
        return self.signer.seal(ticket, round=round)

    def gathered_for(self, ticket: bytes) -> bytes:
        """The JoinRequest.gather a step with `gather=ticket` carries (hivemind's step: bandwidth, mode, user data)."""
        return self.serializer.dumps([self.bandwidth, self.mode.value, self.serializer.dumps(ticket)])

    def lower_target(self, round: int, target_group_size: int) -> bool:
        """Lower round `round`'s target group size (members left the round after it began); a leader holding
        that many members starts its group at once. Returns whether this call started a group."""
        return self._call("_lower_target", 30.0, round=round, target=target_group_size)

    def gather_phase(
        self, round: int, phase: int, payload: bytes, *, group: Sequence[str], group_id: bytes, timeout: float,
        clients: Sequence[str] = (), authors: Sequence[str] | None = None, takers: Sequence[str] = (),
    ) -> GatherResult:  # fmt: skip
        """All-gather a later phase's messages within the group that gathered phase 1 (`authors`: only theirs, in
        that order, as the reducers' reduced parts; `clients`: the group's client members; `takers`: members
        besides the authors that will pull this worker's message, gather._all_gather)."""
        size = self._stage(payload)
        kwargs = dict(phase=phase, payload_size=size, group=list(group), group_id=group_id, timeout=timeout,
                      clients=list(clients), authors=None if authors is None else list(authors), takers=list(takers))  # fmt: skip
        return self._call("_gather_phase", timeout + 30.0, **kwargs)

    def scatter_phase(
        self, round: int, phase: int, payload: bytes, *, group: Sequence[str], group_id: bytes, timeout: float,
        clients: Sequence[str] = (),
    ) -> GatherResult:  # fmt: skip
        """The compressed butterfly's first step for a message sent after the group formed: `payload` cut into one
        part per reducer of `group` (its members but the `clients`); returns the parts of this worker's span, in
        group order (gather._scatter; none for a client member)."""
        size = self._stage(payload)
        kwargs = dict(phase=phase, payload_size=size, group=list(group), group_id=group_id, timeout=timeout, scatter=True,
                      clients=list(clients))  # fmt: skip
        return self._call("_gather_phase", timeout + 30.0, **kwargs)

    def _stage(self, payload: bytes) -> int:
        """Put a message into the shared outbox (the averager process copies it out when called)."""
        if len(payload) > self._outbox.numel():
            raise ValueError(f"a {len(payload)}-byte message does not fit the {self._outbox.numel()}-byte outbox")
        if payload:
            self._outbox.numpy()[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)  # no copy but this one
        return len(payload)

    def _unstage(self, size: int) -> bytes:
        return self._outbox[:size].numpy().tobytes()

    def hold_buffers(
        self, round: int, kind: AverageKind, group: Sequence[str], group_id: bytes, missing: Spans = (),
        counted_by: Sequence[tuple[str, ...] | None] = (),
    ) -> None:  # fmt: skip
        """Keep (and serve to the group) the average the worker wrote into the averaged tensors; called holding
        their lock (`get_tensors()`), which the averager process does not take for it (held.py)."""
        self._call("_hold_buffers", 30.0, round=round, kind=kind, group=tuple(group), group_id=group_id,
                   missing=tuple(missing), counted_by=tuple(counted_by))  # fmt: skip

    def adopt(self, round: int, peers: Sequence[str], average_hash: str, *, wait_s: float, deadline_s: float) -> Collected:
        """Download round `round`'s average from `peers` in order until one's copy hashes to `average_hash`
        (average.average_hash), and keep it as this worker's (what it applies and serves from now on)."""
        kwargs = dict(round=round, peers=list(peers), want=average_hash, wait_s=wait_s, deadline_s=deadline_s)
        return self._call("_adopt", deadline_s + wait_s + 30.0, **kwargs)

    def collect(
        self, round: int, peers: Sequence[str], *, start: HeldAverage | None, wait_s: float, deadline_s: float
    ) -> Collected:
        """Fill `start`'s missing spans (or, with None, get the whole average) from `peers`' copies of round
        `round`'s average, in order, until nothing is missing or `deadline_s` passes."""
        kwargs = dict(round=round, peers=list(peers), start=start, wait_s=wait_s, deadline_s=deadline_s)
        return self._call("_collect", deadline_s + wait_s + 30.0, **kwargs)

    def download_round(
        self, peer_id: str, boundary: int, *, wait_s: float, timeout: float, part: int = swarm_pb2.STATE_WHOLE
    ) -> StateDownload:
        """Download `peer_id`'s state at exactly `boundary` (or the `part` of it a StatePart names), waiting up to
        `wait_s` for it to be complete (STATE_NOW: for the donor to reach it)."""
        kwargs = dict(peer_id=peer_id, boundary=boundary, wait_s=wait_s, timeout=timeout, part=part)
        return self._call("_download_round", timeout + wait_s + 30.0, **kwargs)

    # ----- averager process: the all-reduce -------------------------------------------------
    async def _prepare_round(
        self, round: int, target: int, payload_size: int, admitted: list[str], banned: list[str],
        banned_keys: list[bytes], expected: list[str] | None, leader: str, client: bool, reused: ReusedGroup | None,
        future: MPFuture,
    ) -> None:  # fmt: skip
        try:
            self._reuse_armed = None if reused is None else (round, GroupInfo(
                reused.group_id, tuple(PeerID.from_base58(p) for p in reused.members), reused.gathered))  # fmt: skip
            self._designated.set(leader, self.peer_id.to_base58(), self._matchmaking.min_matchmaking_time * LEAD_SHARE)
            # a client member declares no leadership and refuses to lead (hivemind's client mode of matchmaking); it
            # opens a connection to every member it may group with, over which they reach it (swarm/client_member.py)
            self._matchmaking.client_mode = client
            if client:
                reach_members(self._p2p, [PeerID.from_base58(p) for p in (expected or admitted)])
            self._payload = self._unstage(payload_size) if payload_size >= 0 else None
            self._admitted = frozenset(admitted) - frozenset(banned)
            self.gate.ban(banned, banned_keys)  # a ticket of any worker a banned peer key certifies is refused too
            mm = self._matchmaking
            if not getattr(mm.potential_leaders, "_dilocox_filtered", False):
                ask_designated_then_admitted(mm.potential_leaders, self)
            # a cancelled step unwinds, and never looks again; a reused group is taken instead of looking
            hold_matchmaking_tasks(mm, self._stale_step, self._reused_group)
            track_join_requests(mm)  # a part that comes before its leader's answer waits for it (_outside_group)
            space_queue_reads(mm.group_key_manager)  # hivemind re-reads an empty leader queue in a tight loop
            # a follower the target did not count raises it; a refusal says why (hivemind: at debug level only)
            screen_join_requests(mm, self._count_extra)
            abandon_begun_groups(mm, self._abandons)  # fault injection only
            forget_lost_acceptance(mm)
            self._expected = None if expected is None else frozenset(expected)
            self._extras = set()
            mm.group_key_manager.group_bits = round_group_bits(round)
            # hivemind rotates the bits after a group forms (and fails when a group outgrows the target
            # size); the bits here are set per round, so that update is switched off
            mm.group_key_manager.update_key_on_group_assembled = _keep_group_key
            set_target_size(mm, target)
            self._current_round = round
            self._counted_out.value = -1  # a step of this round looking again (exchange._grouped) starts afresh
            if drop_stale_searches(mm, self._stale_step):
                logger.info("round %d: a search of an earlier round was still looking for a group; cancelled", round)
            future.set_result(None)
        except Exception as e:  # pragma: no cover - reported to the caller
            future.set_exception(e)

    def _abandons(self) -> str:
        return injection.first_armed(injection.FOLLOWER_FAULTS, round=self._current_round, stage=self.stage)

    async def _lower_target(self, round: int, target: int, future: MPFuture) -> None:
        try:  # the followers that joined beyond the expected members still count
            lowered = round == self._current_round and await lower_target(self._matchmaking, target + len(self._extras))
            future.set_result(lowered)
        except Exception as e:  # pragma: no cover - reported to the caller
            future.set_exception(e)

    def _count_extra(self, peer: str) -> bool:
        """Whether `peer`, accepted as a follower, is one this round's target did not count (once per round)."""
        if self._expected is None or peer in self._expected or peer in self._extras:
            return False
        self._extras.add(peer)
        return True

    def _reused_group(self, step: Any) -> GroupInfo | None:
        """The group armed for this round by `prepare_round(reused=...)`, taken once, by a step of this round (a step
        that looks again after it failed uses matchmaking)."""
        armed, self._reuse_armed = self._reuse_armed, None
        if armed is None or armed[0] != self._current_round or self._ticket_round(step.data_for_gather) != armed[0]:
            return None
        logger.debug("round %d: the last round's group formed again without matchmaking", armed[0])
        return armed[1]

    def _stale_step(self, step: Any) -> bool:
        """Whether hivemind's `step` carries the ticket of another round than the one prepared last (a cancelled
        step that hivemind retried: matchmaking.py)."""
        round = self._ticket_round(step.data_for_gather)
        return round is not None and round != self._current_round

    # ----- averager process: refusals ----------------------------------------------------------
    def _refused(self, what: str, reason: str) -> None:
        """Log a refusal at its 1st, 10th, 100th... time (a flood of bad requests is not a flood of logs)."""
        with self._refused_total.get_lock():
            self._refused_total.value += 1
        n = self._refusals.count(reason)
        if n is not None:
            logger.warning("refused %s: %s [%d such so far]", what, reason, n)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        self._grouped_at, self._grouped_round = time.time(), self._current_round
        self._remember_begun(group_info)
        members = [p.to_base58() for p in group_info.peer_ids]  # its parts of the next round are expected (group_reuse.py)
        next_round = self._current_round + 1
        self._reuse_next = (next_round, reuse_group_id(self.run_id, self.stage, next_round, members))
        tickets = self._group_tickets(group_info)  # raises where the group holds a member this worker does not admit
        if all(t.client for t in tickets):
            raise AllreduceException("every member of the group is a client member: nobody could reduce")
        self._group_ranks = agreed_ranks([list(t.ranks) for t in tickets])
        self._group_clients = frozenset(p.to_base58() for p, t in zip(group_info.peer_ids, tickets) if t.client)
        await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return self._last_result
