"""Member records pushed to the stage's other members the moment they change.

A worker's member record (dht.py) says which round's all-reduce it has started, whether it trains and where
its state is. The others read it from the DHT, and a member waiting for a change looked it up again every
0.5 s (membership.wait_for_round): a round's last member to start it was seen up to half a second late, at
every exchange, and every look read all the stage's records through the DHT (issue 37, point 6: events
instead of polls). Now a worker whose record changed also sends it, sealed exactly as stored, straight to
the stage's other members (`MemberPushes.push_member`, by their averagers' `rpc_push_member`); the averager
process hands it to its stage worker (`pushed_records`), whose Membership opens it like a record read from
the DHT (RunRecords.open_member: signed by the worker that pushed it, of this run and stage) and wakes the
waits on it. The DHT stays the record of truth: a push that is lost (a member not known yet, a full queue, a
peer of an older release) costs the poll it replaces, nothing more.

Phase 5's AverageRecords travel the same way (`push_average`, `rpc_push_average`, `pushed_averages`): a member
announcing the hash of its copy sends the sealed record to the other voters of its group as it stores it, and
their votes (vote.py) wake on it instead of reading the group's records from the DHT every 0.2 s.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import P2PContext, PeerID
from hivemind.utils import MPFuture

from ..proto_gen import envelope_pb2
from ..wire import MAX_RECORD_BYTES, swarm_pb2
from .request_limits import peer_limits

__all__ = ["MemberPushes", "Pushed", "PushedAverages", "claimed_round", "take_pushed"]

AVERAGE_EXPIRATION = 0.0  # a pushed AverageRecord carries no expiration: it is used in the round's phase 5 alone
ROUNDS_AHEAD = 2  # AverageRecords pushed for rounds up to this far after the one voting are kept for their vote

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 2.0  # a push that takes longer is dropped: the member reads the record from the DHT
HAND_OVER_S = 2.0  # the heartbeat waits at most this long for a starved averager process to take a push
QUEUED = 256  # pushes waiting for the stage worker; more are dropped (a flood costs the flooder's pushes only)

Pushed = tuple[str, bytes, float]
"""(the worker that pushed it, the sealed record, its DHT expiration), as the stage worker takes it."""


class MemberPushes:
    """Mixin for DilocoxAverager: push this worker's changed member record, take the others'."""

    prefix: str
    _p2p: Any

    def _init_pushes(self) -> None:
        self.pushed_records: Any = mp.Queue(maxsize=QUEUED)  # averager process -> stage worker
        self.pushed_averages: Any = mp.Queue(maxsize=QUEUED)  # the same for phase 5's AverageRecords
        self._pushing: set[asyncio.Task] = set()

    def push_member(self, value: bytes, expiration: float, peers: Sequence[str]) -> None:
        """Send the sealed member record `value` to `peers` (their averagers), in the background; raises
        TimeoutError if the averager process did not take it within HAND_OVER_S (the heartbeat's next beat must
        not wait for a starved process: the record is in the DHT already)."""
        self._call("_push_member", HAND_OVER_S, value=value, expiration=expiration, peers=list(peers))  # type: ignore[attr-defined]

    def push_average(self, value: bytes, peers: Sequence[str]) -> None:
        """Send the sealed AverageRecord `value` to `peers` (the other voters of this worker's group), in the
        background; raises TimeoutError as `push_member` does (the record goes to the DHT all the same)."""
        self._call("_push_member", HAND_OVER_S, value=value, expiration=AVERAGE_EXPIRATION, peers=list(peers),  # type: ignore[attr-defined]
                   rpc="rpc_push_average")  # fmt: skip

    async def _push_member(
        self, value: bytes, expiration: float, peers: list[str], future: MPFuture, rpc: str = "rpc_push_member"
    ) -> None:  # fmt: skip
        request = swarm_pb2.MemberPush(record=value, expiration=expiration)
        for peer in peers:
            task = asyncio.create_task(self._push_to(peer, request, rpc))
            self._pushing.add(task)  # asyncio holds tasks weakly
            task.add_done_callback(self._pushing.discard)
        future.set_result(None)

    async def _push_to(self, peer: str, request: swarm_pb2.MemberPush, rpc: str) -> None:
        try:
            stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)  # type: ignore[attr-defined]
            await asyncio.wait_for(getattr(stub, rpc)(request), timeout=PUSH_TIMEOUT_S)
        except Exception as e:  # the DHT holds the record: the member reads it there
            logger.debug("could not push a record to %s (%s): %r", peer, rpc, e)

    async def rpc_push_member(self, request: swarm_pb2.MemberPush, context: P2PContext) -> swarm_pb2.MemberPush:
        """A member's changed record, for the stage worker to open (Membership); never answered with an error."""
        self._take_push(request, context, self.pushed_records, "a member record")
        return swarm_pb2.MemberPush()

    async def rpc_push_average(self, request: swarm_pb2.MemberPush, context: P2PContext) -> swarm_pb2.MemberPush:
        """A voter's AverageRecord, for the stage worker's phase 5 to open (vote.py); never answered with an error."""
        self._take_push(request, context, self.pushed_averages, "an average record")
        return swarm_pb2.MemberPush()

    def _take_push(self, request: swarm_pb2.MemberPush, context: P2PContext, into: Any, what: str) -> None:
        """Queue a pushed record for the stage worker, unless its sender pushes faster than any honest member
        (request_limits.py, family "pushes": its pushes would crowd the others' out of the shared queue)."""
        sender = context.remote_id.to_base58()
        reason = peer_limits(self).refusal("pushes", sender)
        if reason:
            self._refused(f"{what} pushed by {sender}", reason)  # type: ignore[attr-defined]
        elif 0 < len(request.record) <= MAX_RECORD_BYTES:
            try:
                into.put_nowait((sender, request.record, request.expiration))
            except queue.Full:
                logger.debug("dropped %s pushed by %s: the stage worker is behind", what, sender)


def take_pushed(pushed: Any, timeout: float) -> list[Pushed]:
    """The records pushed so far, waiting up to `timeout` for the first one ([] if none came)."""
    try:
        items = [pushed.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(pushed.get_nowait())
        except queue.Empty:
            return items


def claimed_round(value: bytes) -> int | None:
    """The round a sealed record says it is about, unverified (None: not an envelope): which vote it waits for."""
    try:
        return int(envelope_pb2.Envelope.FromString(envelope_pb2.SignedEnvelope.FromString(value).body).round)
    except Exception:  # noqa: BLE001 - malformed bytes of any kind
        return None


class PushedAverages:
    """The AverageRecords other voters pushed to this worker (DilocoxAverager.pushed_averages), for phase 5 of
    their round (vote.py): a member ahead pushes its round's record before this worker votes, so records of the
    next ROUNDS_AHEAD rounds wait for their vote; earlier ones are dropped unopened."""

    def __init__(self, queue: Any, records: Any):
        self.queue, self.records = queue, records  # records: dht.RunRecords, which opens them
        self._waiting: dict[int, list[tuple[str, bytes]]] = {}

    def take(self, round: int, timeout: float) -> dict[str, Any]:
        """The records pushed for `round` since the last take, opened and checked (sender -> dht.Opened, the latest
        each sent), waiting up to `timeout` for the next push of any round."""
        for sender, value, _ in take_pushed(self.queue, timeout):
            claimed = claimed_round(value)
            if claimed is not None and round <= claimed <= round + ROUNDS_AHEAD:
                self._waiting.setdefault(claimed, []).append((sender, value))
        for earlier in [r for r in self._waiting if r < round]:
            del self._waiting[earlier]
        out: dict[str, Any] = {}
        for sender, value in self._waiting.pop(round, []):
            opened = self.records.open_average(sender, value, round)
            if opened is not None and (sender not in out or opened.envelope.sent_at >= out[sender].envelope.sent_at):
                out[sender] = opened
        return out

