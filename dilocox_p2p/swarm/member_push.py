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

from ..wire import MAX_RECORD_BYTES, swarm_pb2

__all__ = ["MemberPushes", "Pushed", "take_pushed"]

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
        self._pushing: set[asyncio.Task] = set()

    def push_member(self, value: bytes, expiration: float, peers: Sequence[str]) -> None:
        """Send the sealed member record `value` to `peers` (their averagers), in the background; raises
        TimeoutError if the averager process did not take it within HAND_OVER_S (the heartbeat's next beat must
        not wait for a starved process: the record is in the DHT already)."""
        self._call("_push_member", HAND_OVER_S, value=value, expiration=expiration, peers=list(peers))  # type: ignore[attr-defined]

    async def _push_member(self, value: bytes, expiration: float, peers: list[str], future: MPFuture) -> None:
        request = swarm_pb2.MemberPush(record=value, expiration=expiration)
        for peer in peers:
            task = asyncio.create_task(self._push_to(peer, request))
            self._pushing.add(task)  # asyncio holds tasks weakly
            task.add_done_callback(self._pushing.discard)
        future.set_result(None)

    async def _push_to(self, peer: str, request: swarm_pb2.MemberPush) -> None:
        try:
            stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)  # type: ignore[attr-defined]
            await asyncio.wait_for(stub.rpc_push_member(request), timeout=PUSH_TIMEOUT_S)
        except Exception as e:  # the DHT holds the record: the member reads it there
            logger.debug("could not push the member record to %s: %r", peer, e)

    async def rpc_push_member(self, request: swarm_pb2.MemberPush, context: P2PContext) -> swarm_pb2.MemberPush:
        """A member's changed record, for the stage worker to open (Membership); never answered with an error."""
        if 0 < len(request.record) <= MAX_RECORD_BYTES:
            try:
                self.pushed_records.put_nowait((context.remote_id.to_base58(), request.record, request.expiration))
            except queue.Full:
                logger.debug("dropped a member record pushed by %s: the stage worker is behind", context.remote_id)
        return swarm_pb2.MemberPush()


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
