"""hivemind's queue of leaders finds a leader that declared itself after the queue's last read; a refused request is
logged with hivemind's reason.

    pytest tests/swarm/test_leader_queue.py -q

Real hivemind DHT nodes on loopback, hivemind's own GroupKeyManager and PotentialLeaders (matchmaking.pop_while_unsure).
"""

from __future__ import annotations

import asyncio
import logging
import time

import hivemind
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.averaging.control import StepControl
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time

from dilocox_p2p.identity import peer_id_of
from dilocox_p2p.swarm.matchmaking import pop_while_unsure, screen_join_requests

pytestmark = pytest.mark.swarm

ROUND_WAIT = 10.0  # hivemind's min_matchmaking_time, as a stage worker sets it (round_wait)
LAG = 2.5  # a follower declares this much later than hivemind's default (exchange.FOLLOWER_LAG_S)
FOUND_WITHIN_S = 2.0


def _peer() -> PeerID:
    return PeerID.from_base58(peer_id_of(Ed25519PrivateKey.generate()))


async def _search_meets_a_leader_declared_after_its_last_read(dht: hivemind.DHT, other: hivemind.DHT) -> float:
    """A worker declared as a follower (round_wait + LAG ahead) searches hivemind's queue; the only leader it has read
    is due after its search ends (a follower armed to follow, declared later still), so hivemind stops reading. A
    member then declares itself a moment earlier than the worker. Returns how long the worker took to pop it."""
    me, late, early = _peer(), _peer(), _peer()
    keys = GroupKeyManager(dht, prefix="queue", initial_group_bits="0", target_group_size=3)
    theirs = GroupKeyManager(other, prefix="queue", initial_group_bits="0", target_group_size=3)
    key = keys.current_key
    now = get_dht_time()
    assert await theirs.declare_averager(key, late, expiration_time=now + ROUND_WAIT + 2 * LAG + 1.0)
    step = StepControl(scheduled_time=now + ROUND_WAIT + LAG, deadline=now + ROUND_WAIT + 2 * LAG, allow_retries=False,
                       weight=1.0, data_for_gather=b"")  # fmt: skip
    step.attach(MPFuture(), MPFuture())
    leaders = PotentialLeaders(me, min_matchmaking_time=ROUND_WAIT, target_group_size=3)
    try:
        async with leaders.begin_search(step, keys, declare=True):
            popping = asyncio.ensure_future(_pop(leaders))
            while leaders.max_assured_time == float("-inf") or leaders.declared_expiration_time == float("inf"):
                await asyncio.sleep(0.01)  # the queue was read once, and this worker declared itself
            await asyncio.sleep(0.5)  # hivemind's queue, had it read again, would have done so by now
            assert await theirs.declare_averager(key, early, expiration_time=leaders.declared_expiration_time - 0.01)
            declared = time.monotonic()
            found = await asyncio.wait_for(popping, timeout=ROUND_WAIT)
            assert found == early, "popped another leader than the one due before this worker"
            return time.monotonic() - declared
    finally:
        step.allow_allreduce()  # (a step never triggered warns when it is deleted)


async def _pop(leaders: PotentialLeaders) -> PeerID:
    """The next leader, as hivemind's search takes it: a pop invalidated by this worker's own (re)declaration is
    tried again (Matchmaking._request_join_potential_leaders)."""
    while True:
        try:
            return await pop_while_unsure(leaders, leaders.pop_next_leader)
        except asyncio.TimeoutError:
            continue


def test_a_leader_that_declares_after_the_queue_was_read_and_is_due_earlier_is_found_within_a_second():
    # hivemind reads the round's declarations again only while the leader at its queue's top is due before the search
    # ends: here that leader is due after, and the member that declared later went unseen for the whole round (two
    # members each took the other for the later one, and all three stranded: test_elastic, 2 busy cores)
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = None
    try:
        second = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(),
                              start=True)  # fmt: skip
        took = asyncio.run(_search_meets_a_leader_declared_after_its_last_read(first, second))
    finally:
        for dht in (second, first):
            if dht is not None:
                dht.shutdown()
    assert took < FOUND_WITHIN_S, f"the leader declared after the queue's last read was found after {took:.2f} s"


async def _refuse_a_request(dht: hivemind.DHT) -> averaging_pb2.MessageFromLeader | None:
    """What hivemind's own Matchmaking of a worker that does not look for a group answers ASKER's request to join it."""
    p2p = await dht.replicate_p2p()
    mm = Matchmaking(p2p, b"schema", dht, servicer_type=DecentralizedAverager, prefix="queue", target_group_size=3,
                     min_group_size=2, min_matchmaking_time=ROUND_WAIT, request_timeout=5.0, client_mode=False)  # fmt: skip
    screen_join_requests(mm, extra=lambda peer: False)
    screen_join_requests(mm, extra=lambda peer: False)  # wrapped once however often it is called
    request = averaging_pb2.JoinRequest(schema_hash=b"schema", expiration=get_dht_time() + ROUND_WAIT,
                                        group_key=mm.group_key_manager.current_key)  # fmt: skip
    return mm._check_reasons_to_reject(request, P2PContext(handle_name="join", local_id=p2p.peer_id, remote_id=ASKER))


ASKER = _peer()


def test_a_refused_request_to_join_is_logged_with_hiveminds_reason(caplog):
    # hivemind tells the follower why at debug level only: a round whose members refused each other at once (round 0
    # at a busy start, "no group after 0.00 s") is read from the leader's line
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        with caplog.at_level(logging.INFO, logger="dilocox_p2p.swarm.matchmaking"):
            refusal = asyncio.run(_refuse_a_request(dht))
    finally:
        dht.shutdown()
    assert refusal is not None and refusal.code == averaging_pb2.NOT_LOOKING_FOR_GROUP
    lines = [r.getMessage() for r in caplog.records if "request to join this worker's group" in r.getMessage()]
    assert lines == [f"refused {ASKER}'s request to join this worker's group: NOT_LOOKING_FOR_GROUP"], lines
