"""Who may group with whom: the signed group tickets of hivemind's matchmaking, and the round's designated leader.

A stage worker's join request carries a signed GroupTicket in hivemind's JoinRequest.gather (envelope.proto):
a leader takes only members with a valid ticket of its round that the round admits (live, not banned,
`_ticket_refusal`), a follower asks only such leaders (`ask_designated_then_admitted`), and a member whose
group holds any other leaves it (averager._aggregate_with_group, `_read_ticket`). A follower asks the round's
designated leader first (matchmaking.DesignatedLeader); a request that comes before its leader looks for the
round's group waits for that (`_wait_to_lead`), and one from a member this worker is itself asking to lead it
is refused at once where that member is to lead (matchmaking.py: a mutual ask). A member whose leader accepted
it and whose answer stream then closed asks a member of the group whose part reaches it which group began
(`rpc_begun_group`) and joins it late (`_join_begun`). A leader leaves the close of a join stream to its
follower, once the follower has read the last answer (stream_close.py): a leader that closed first could lose
that answer on the way.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, AsyncIterator  # typing's: hivemind reads rpc handlers' stream hints by their _name

from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, as_aiter

from ..errors import WireRejected
from ..proto_gen import envelope_pb2
from .matchmaking import (
    joining, looking_for_group, lost_acceptance, outside_every_group, pop_while_unsure, refuses_mutual_ask,
)
from .member_push import claimed_round
from .request_limits import peer_limits
from .stream_close import leave_close_to_caller

__all__ = ["GroupAdmission", "ask_designated_then_admitted"]

logger = logging.getLogger(__name__)

JOIN_POLL_S = 0.05  # a part that came before its leader's answer looks this often whether the answer came (_outside_group)
JOIN_WAIT_POLL_S = 0.05  # a request that came before its leader looks checks this often whether it looks (no network)
BEGUN_KEPT = 8  # the latest groups this worker ran, answered to a member that lost its leader's BEGIN_ALLREDUCE


async def _drained(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


class GroupAdmission:
    """Mixin for DilocoxAverager (averager process): group tickets, and join requests as a leader takes them."""

    _admitted: frozenset[str]
    _asked_to_lead: Any
    _begun: collections.OrderedDict[bytes, GroupInfo]  # group id -> the groups this worker ran, latest last
    _joins_begun: dict[bytes, asyncio.Task]  # group id -> this worker's late join of it (`_join_begun`)
    _running_groups: dict[bytes, Any]
    peer_id: PeerID
    prefix: str
    _current_round: int
    _grouped_round: int
    _matchmaking: Any
    serializer: Any
    gate: Any
    _refused: Any
    _outside_groups: Any  # collections.deque of group ids found counted out (averager.py)
    _reuse_round: Any  # the round a group formed without matchmaking may be of (averager.py)
    _counted_out: Any
    next_chunk_timeout: float

    def _sealed_ticket(self, gathered: bytes) -> Any:
        """The signed ticket in a JoinRequest.gather: hivemind's (bandwidth, mode, user data), ours the user data."""
        _, _, user = self.serializer.loads(gathered)
        return self.serializer.loads(user)

    def _ticket_round(self, gathered: bytes) -> int | None:
        """The round a JoinRequest.gather's ticket names, unverified (None: not a ticket of ours; the group's
        checks refuse it)."""
        try:
            return claimed_round(self._sealed_ticket(gathered))
        except Exception:  # noqa: BLE001 - not hivemind's (bandwidth, mode, user data)
            return None

    def _ticket_refusal(self, peer: str, gathered: bytes, *, joining: bool) -> str:
        """Why `peer`'s JoinRequest.gather (hivemind's (bandwidth, mode, user data)) does not admit it to this
        round's group ("" if it does). A peer `joining` this worker's group must also be a live member that
        this worker has not banned; in a group already formed, a valid ticket is enough (bans are each
        worker's own: the content checks decide there, alike on every member)."""
        if joining and peer not in self._admitted:
            return "not a live, admitted, unbanned member of this stage"
        return self._read_ticket(peer, gathered, even_banned=not joining)[1]

    def _read_ticket(self, peer: str, gathered: bytes, *, even_banned: bool) -> tuple[envelope_pb2.GroupTicket | None, str]:
        """`peer`'s group ticket from its JoinRequest.gather, opened (signed by `peer`, for this round), or why not."""
        try:
            opened = self.gate.open(self._sealed_ticket(gathered), envelope_pb2.GroupTicket, sender=peer,
                                    round=self._current_round, even_banned=even_banned)  # fmt: skip
        except WireRejected as e:
            return None, str(e)
        except Exception as e:
            return None, f"unreadable group ticket ({type(e).__name__})"
        return opened.message, ""

    def _group_tickets(self, group_info: GroupInfo) -> list[envelope_pb2.GroupTicket]:
        """The group tickets of a formed group's members, in group order (this worker's own, if unreadable: an empty
        one). Raises AllreduceException where a leader let in a member this worker does not admit: it leaves the group."""
        me, tickets = self.peer_id.to_base58(), []
        for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
            peer = peer_id.to_base58()
            ticket, refusal = self._read_ticket(peer, gathered, even_banned=True)
            if refusal and peer != me:
                self._refused(f"a group of round {self._current_round} holding {peer}", refusal)
                raise AllreduceException(f"the group holds {peer}, which this worker does not admit: {refusal}")
            tickets.append(ticket if ticket is not None else envelope_pb2.GroupTicket())
        return tickets

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """Answer a join request (`_answer_join`), then leave the close of the stream to the follower: hivemind's
        request_join_group closes it, in its `finally`, as soon as it has read the last answer (stream_close.py)."""
        async for message in self._answer_join(request, context):
            yield message
        await leave_close_to_caller(logger, context.remote_id, "join stream", "this leader's answer")

    async def _answer_join(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        peer, limits = context.remote_id.to_base58(), peer_limits(self)
        refusal = limits.refusal("matchmaking", peer)  # before a request is held or its ticket checked
        if refusal:
            self._refused(f"{peer}'s request to join round {self._current_round}'s group", refusal)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        with limits.held("matchmaking", peer):
            await self._wait_to_lead(self._ticket_round(request.gather), peer)
            refusal = self._ticket_refusal(peer, request.gather, joining=True)
            if refusal:
                self._refused(f"{peer}'s request to join round {self._current_round}'s group", refusal)
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            if refuses_mutual_ask(self._matchmaking, peer, request.expiration):  # both waited out request_timeout
                logger.debug("refused %s's request to lead it: this worker is asking it to lead", peer)
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_A_LEADER)
                return
            async for message in super().rpc_join_group(request, context):
                yield message

    async def _wait_to_lead(self, round: int | None, peer: str) -> None:
        """A request of `peer` to join round `round`'s group that comes before this worker looks for that group waits until
        it does (the designated leader is asked as soon as its followers start the round, which may be a moment
        before it does: matchmaking.DesignatedLeader), for most of the request's time at most: then it is
        answered as hivemind would. The stage worker learns at once that a member waits for it to lead
        (averager.asked_to_lead): one still waiting for a late member to start the round stops waiting and
        looks (exchange.py, phase 1)."""
        mm = self._matchmaking
        deadline = time.monotonic() + max(mm.request_timeout - 1.0, 0.0)
        while round is not None and time.monotonic() < deadline and (
            round > self._current_round
            or round == self._current_round and self._grouped_round != round and not looking_for_group(mm)
        ):  # fmt: skip
            # the stage worker stops waiting for late members (exchange.py); a ticket's round is not verified yet:
            # only an admitted member's, at most a round ahead, counts
            if self._asked_to_lead.value < round <= self._current_round + 1 and peer in self._admitted:
                self._asked_to_lead.value = round
            await asyncio.sleep(JOIN_WAIT_POLL_S)

    # ----- a member whose leader's BEGIN_ALLREDUCE was lost (matchmaking.py) ------------------------
    def _remember_begun(self, group: GroupInfo) -> None:
        """Keep `group` (one this worker runs) for `rpc_begun_group`."""
        self._begun[group.group_id] = group
        while len(self._begun) > BEGUN_KEPT:
            self._begun.popitem(last=False)

    async def rpc_begun_group(self, request: averaging_pb2.JoinRequest, context: P2PContext) -> averaging_pb2.MessageFromLeader:
        """The group `request.group_key` (its id in hex) names, as its leader's BEGIN_ALLREDUCE said it, to a caller
        whose valid ticket of this round (`request.gather`, as in a join request) the group holds: one whose leader
        accepted it and whose answer stream then closed (matchmaking.py). BAD_GROUP_ID to anyone else."""
        peer = context.remote_id
        reason = peer_limits(self).refusal("matchmaking", peer.to_base58())
        if reason:
            self._refused(f"{peer.to_base58()}'s question which group began", reason)
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
        try:
            group = self._begun.get(bytes.fromhex(request.group_key))
        except ValueError:
            group = None
        refusal = self._read_ticket(peer.to_base58(), request.gather, even_banned=False)[1]
        if group is None or refusal or peer not in group.peer_ids:
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_ID)
        return averaging_pb2.MessageFromLeader(
            code=averaging_pb2.BEGIN_ALLREDUCE, group_id=group.group_id,
            ordered_peer_ids=[p.to_bytes() for p in group.peer_ids], gathered=group.gathered,
        )  # fmt: skip

    async def _join_begun(self, group_id: bytes, member: PeerID) -> bool:
        """Ask `member` (whose part of group `group_id` reached this worker) which group began, and join it if it
        holds this worker and this worker is still outside every group; whether it did. Parts of that group that
        come meanwhile ask the same question once."""
        task = self._joins_begun.get(group_id)
        if task is None:
            task = self._joins_begun[group_id] = asyncio.create_task(self._ask_and_join(group_id, member))
            while len(self._joins_begun) > BEGUN_KEPT:
                self._joins_begun.pop(next(iter(self._joins_begun)))
        try:
            return await asyncio.shield(task)
        except Exception as e:  # noqa: BLE001 - not joined: the part is answered as outside the group
            logger.info("could not join group %s late: %r", group_id.hex()[:8], e)
            return False

    async def _ask_and_join(self, group_id: bytes, member: PeerID) -> bool:
        mm = self._matchmaking
        reused = self._reused_elsewhere(group_id)
        step = mm.step_control  # the search running now (hivemind sets it for the search, None after)
        if step is None:
            return False
        stub = type(self).get_stub(self._p2p, member, namespace=self.prefix)  # type: ignore[attr-defined]
        request = averaging_pb2.JoinRequest(gather=step.data_for_gather, group_key=group_id.hex())
        answer = await asyncio.wait_for(stub.rpc_begun_group(request), timeout=mm.request_timeout)
        me = self.peer_id.to_bytes()
        if (answer.code != averaging_pb2.BEGIN_ALLREDUCE or answer.group_id != group_id
                or me not in answer.ordered_peer_ids or len(answer.gathered) != len(answer.ordered_peer_ids)):
            logger.info("%s named no group %s holding this worker: it stays out", member, group_id.hex()[:8])
            return False
        async with mm.lock_request_join_group:
            if group_id in self._running_groups:
                return True
            if not (outside_every_group(mm, group_id) and mm.is_looking_for_group):
                return False  # it found another group meanwhile, or stopped looking
            group = GroupInfo(group_id, tuple(PeerID(p) for p in answer.ordered_peer_ids), tuple(answer.gathered))
            mm.assembled_group.set_result(group)
        why = ("the others of the last round's group formed it again without matchmaking" if reused
               else "its leader accepted this worker, and its answer that the group began was lost")  # fmt: skip
        logger.info("joined group %s late: %s; %s named the group", group_id.hex()[:8], why, member)
        return True


    # ----- parts of groups this worker is not in (matchmaking.outside_every_group) ----------------------
    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """As hivemind's, but a part of a group this worker is not in, nor about to join, is answered BAD_GROUP_ID
        at once (matchmaking.outside_every_group). hivemind waits for some group to register: a leader that
        counted this worker in after it had given up on the leader waited out its timeouts for it."""
        peer, limits = context.remote_id.to_base58(), peer_limits(self)
        refusal = limits.refusal("parts", peer)  # before a byte of the stream is read (request_limits.py)
        if refusal:
            self._refused(f"parts streamed by {peer}", refusal)
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        with limits.held("parts", peer):
            async for message in self._aggregate_part(stream, context):
                yield message

    async def _aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        request = await anext(stream)
        if await self._outside_group(request.group_id, context.remote_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            # read the rest of the sender's parts before closing: a stream closed under its writer broke the
            # sender's pipe, and it took that for a failed reducer, not a member outside the group
            try:
                await asyncio.wait_for(_drained(stream), timeout=self.next_chunk_timeout)
            except Exception as e:
                logger.debug("the parts of a group this worker is not in did not end: %r", e)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _outside_group(self, group_id: bytes, sender: PeerID | None = None) -> bool:
        """matchmaking.outside_every_group, for a request of a member of group `group_id`, once this worker's
        requests to leaders in flight have ended (at most the matchmaking's request_timeout and a second): the
        leader of that group may have taken one and started before its answer came. Asked while this worker
        looks for a group, it also marks the round counted out (`counted_out`). A group found so once stays so:
        this worker can never join a group that began without it, and the parts of its other members are answered
        at once even while this worker looks for a group again (exchange._grouped) and waits for a leader's answer:
        waiting for that answer, it kept one of them past its sender and chunk timeouts (12-18 s, busy core). A
        worker whose leader accepted it in this round and whose answer stream then closed asks `sender`, a member
        of that group, which group began, and joins it late (group_admission.GroupAdmission._join_begun)."""
        deadline = time.monotonic() + self._matchmaking.request_timeout + 1.0
        while self._joining_maybe(group_id) and time.monotonic() < deadline:
            await asyncio.sleep(JOIN_POLL_S)
        return await self._judged_outside(group_id, sender)

    async def _outside_group_now(self, group_id: bytes, sender: PeerID | None = None) -> bool:
        """`_outside_group` without waiting for requests in flight (while one is, this worker may yet be in the
        group: False), asked again while a request of a member of `group_id` waits for this worker's message
        (gather.rpc_download_message): a request judged while this worker still followed a leader, or while the
        search that found it outside unwound, waited out its whole wait for a message that never came (21 s of a
        round in CI run 206), though another request had found the group outside meanwhile."""
        if self._joining_maybe(group_id):
            return False
        return await self._judged_outside(group_id, sender)

    def _joining_maybe(self, group_id: bytes) -> bool:
        """Whether a request to a leader in flight may yet put this worker into `group_id`, or this worker has yet to
        begin the round whose group its last group formed again without matchmaking (group_reuse.py)."""
        return (group_id not in self._running_groups and group_id not in self._outside_groups
                and (joining(self._matchmaking) or self._reuse_pending(group_id)))  # fmt: skip

    def _reuse_pending(self, group_id: bytes) -> bool:
        """Whether `group_id` is the group this worker's last group forms again without matchmaking in a round this
        worker has not begun looking for a group of: a member ahead sent its part first (group_reuse.py)."""
        round = self._reuse_round(group_id)
        if round is None:
            return False
        return round > self._current_round or (
            round == self._current_round and self._grouped_round != round and not self._matchmaking.is_looking_for_group
        )  # fmt: skip

    def _reused_elsewhere(self, group_id: bytes) -> bool:
        """Whether `group_id` is this round's group formed without matchmaking by the others of its last group, while
        this worker looks for the round's group through matchmaking: it joins it late (group_reuse.py)."""
        return self._reuse_round(group_id) == self._current_round and self._matchmaking.is_looking_for_group

    async def _judged_outside(self, group_id: bytes, sender: PeerID | None) -> bool:
        if group_id in self._running_groups:
            return False
        if group_id in self._outside_groups:  # found so by another request, maybe while this one waited
            return True
        outside = outside_every_group(self._matchmaking, group_id)
        if outside and sender is not None and (lost_acceptance(self._matchmaking) or self._reused_elsewhere(group_id)):
            outside = not await self._join_begun(group_id, sender)
        if outside:
            self._outside_groups.append(group_id)
            if self._matchmaking.is_looking_for_group:
                self._counted_out.value = self._current_round
        return outside


def ask_designated_then_admitted(leaders: Any, averager: Any) -> None:
    """hivemind's follower asks leaders in the order of its queue, read from the DHT: a follower asks the round's
    designated leader first, directly, and a designated leader waits for its followers (matchmaking.DesignatedLeader);
    then leaders come from the queue, skipping those this round does not admit."""
    pop = leaders.pop_next_leader

    async def pop_admitted() -> PeerID:
        while True:
            leader = await averager._designated.next() or await pop_while_unsure(leaders, pop)
            if leader.to_base58() in averager._admitted:
                return leader
            logger.debug("not asking %s to lead: not an admitted member of this round", leader)

    leaders.pop_next_leader = pop_admitted
    leaders._dilocox_filtered = True
