"""Who may group with whom: the signed group tickets of hivemind's matchmaking, and the round's designated leader.

A stage worker's join request carries a signed GroupTicket in hivemind's JoinRequest.gather (envelope.proto):
a leader takes only members with a valid ticket of its round that the round admits (live, not banned,
`_ticket_refusal`), a follower asks only such leaders (`ask_designated_then_admitted`), and a member whose
group holds any other leaves it (averager._aggregate_with_group, `_read_ticket`). A follower asks the round's
designated leader first (matchmaking.DesignatedLeader); a request that comes before its leader looks for the
round's group waits for that (`_wait_to_lead`), and one from a member this worker is itself asking to lead it
is refused at once where that member is to lead (matchmaking.py: a mutual ask).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator  # typing's: hivemind reads rpc handlers' stream hints by their _name

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from ..errors import WireRejected
from ..proto_gen import envelope_pb2
from .matchmaking import looking_for_group, refuses_mutual_ask

__all__ = ["GroupAdmission", "ask_designated_then_admitted"]

logger = logging.getLogger(__name__)

JOIN_WAIT_POLL_S = 0.05  # a request that came before its leader looks checks this often whether it looks (no network)


class GroupAdmission:
    """Mixin for DilocoxAverager (averager process): group tickets, and join requests as a leader takes them."""

    _admitted: frozenset[str]
    _asked_to_lead: Any
    _current_round: int
    _grouped_round: int
    _matchmaking: Any
    serializer: Any
    gate: Any
    _refused: Any

    def _sealed_ticket(self, gathered: bytes) -> Any:
        """The signed ticket in a JoinRequest.gather: hivemind's (bandwidth, mode, user data), ours the user data."""
        _, _, user = self.serializer.loads(gathered)
        return self.serializer.loads(user)

    def _ticket_round(self, gathered: bytes) -> int | None:
        """The round a JoinRequest.gather's ticket names, unverified (None: not a ticket of ours; the group's
        checks refuse it)."""
        try:
            signed = envelope_pb2.SignedEnvelope.FromString(self._sealed_ticket(gathered))
            return envelope_pb2.Envelope.FromString(signed.body).round
        except Exception:  # noqa: BLE001
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

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        peer = context.remote_id.to_base58()
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


def ask_designated_then_admitted(leaders: Any, averager: Any) -> None:
    """hivemind's follower asks leaders in the order of its queue, read from the DHT: a follower asks the round's
    designated leader first, directly, and a designated leader waits for its followers (matchmaking.DesignatedLeader);
    then leaders come from the queue, skipping those this round does not admit."""
    pop = leaders.pop_next_leader

    async def pop_admitted() -> PeerID:
        while True:
            leader = await averager._designated.next() or await pop()
            if leader.to_base58() in averager._admitted:
                return leader
            logger.debug("not asking %s to lead: not an admitted member of this round", leader)

    leaders.pop_next_leader = pop_admitted
    leaders._dilocox_filtered = True
