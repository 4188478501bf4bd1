"""One peer cannot ask a worker's averager or DHT node more than any honest member does: its pushes, join requests,
part streams and DHT finds beyond its rate or its share of held requests are refused at once, and the other members'
go on (request_limits.py, hivemind_patches.limit_dht_requests; issue 38, point 4).

    pytest tests/swarm/test_request_limits.py -q

Real hivemind DHT nodes, averager processes and p2p daemons on loopback; the flooding caller of the join test is a
P2P of its own in this process.
"""

from __future__ import annotations

import asyncio
import time

import hivemind

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.p2p.servicer import ServicerBase
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from dilocox_p2p.swarm.averager import DilocoxAverager
from dilocox_p2p.swarm.hivemind_patches import DHT_REQUEST_BURST, DHT_REQUESTS_PER_S, limit_dht_requests
from dilocox_p2p.swarm.member_push import QUEUED, take_pushed
from dilocox_p2p.swarm.request_limits import MAX_HELD_PER_PEER, REQUEST_BURST, REQUESTS_PER_S
from tests.swarm.test_allreduce import Group

pytestmark = pytest.mark.swarm

REQUEST_TIMEOUT_S = 5.0  # a join request naming a round ahead is held up to this less a second (_wait_to_lead)


@pytest.fixture
def members(request):
    members = Group(3, request_timeout=REQUEST_TIMEOUT_S)  # three averager processes, each with its DHT node
    request.addfinalizer(members.close)
    return members


def _taken(pushed, *, within: float) -> list[str]:
    """Who pushed the records queued so far, waiting until none came for `within` seconds."""
    senders: list[str] = []
    while batch := take_pushed(pushed, within):
        senders += [sender for sender, _, _ in batch]
    return senders


def test_a_peer_that_pushes_faster_than_any_honest_one_crowds_nobody_out_of_the_queue_and_is_taken_again_after(members):
    # a flood of pushed records filled the queue every member's pushes share (QUEUED): the others' were dropped until
    # the stage worker caught up. Now one peer's pushes beyond its rate are refused before they are queued
    flooder, honest, asked = members.averagers[1], members.averagers[2], members.ids[0]
    flood = QUEUED + 44
    assert flood > REQUEST_BURST + 2 * REQUESTS_PER_S
    started = time.monotonic()
    for i in range(flood):  # any bytes: the stage worker opens them (and refuses these), the averager only queues
        flooder.push_member(b"flood %d" % i, 0.0, [asked])
    handed = time.monotonic() - started
    flooded = _taken(members.averagers[0].pushed_records, within=3.0)
    honest.push_member(b"honest", 0.0, [asked])
    after = _taken(members.averagers[0].pushed_records, within=3.0)
    assert REQUEST_BURST <= len(flooded) <= REQUEST_BURST + REQUESTS_PER_S * (handed + 2.0) + 1, (len(flooded), handed)
    assert after == [members.ids[2]], "another member's push was crowded out"
    time.sleep(2 / REQUESTS_PER_S)  # a quiet spell gives the flooder tokens back
    flooder.push_member(b"again", 0.0, [asked])
    assert _taken(members.averagers[0].pushed_records, within=3.0) == [members.ids[1]]


async def _ask_to_join(leader: PeerID, maddrs, prefix: str, ticket: bytes, flood: int) -> list[tuple[float, int]]:
    """`flood` join requests at once from a P2P of this process, each carrying `ticket`: (seconds until the
    first answer, its code) for each."""
    caller = await P2P.create(initial_peers=maddrs)
    try:
        stub = DilocoxAverager.get_stub(caller, leader, namespace=prefix)
        request = averaging_pb2.JoinRequest(schema_hash=b"", expiration=time.time() + 30, gather=ticket)

        async def one() -> tuple[float, int]:
            started = time.monotonic()
            stream = await stub.rpc_join_group(request)
            answer = await asyncio.wait_for(anext(stream), timeout=3 * REQUEST_TIMEOUT_S)
            return time.monotonic() - started, answer.code

        return await asyncio.gather(*(one() for _ in range(flood)))
    finally:
        await caller.shutdown()


def test_join_requests_of_one_peer_beyond_the_most_it_may_have_held_are_refused_at_once(members):
    # a join request naming a round ahead is held for most of request_timeout (a follower may ask its designated
    # leader a moment before the leader looks: group_admission._wait_to_lead), and one peer could have any number
    # held, each a coroutine polling. Now MAX_HELD_PER_PEER are; the rest are refused at once
    leader, maddrs = PeerID.from_base58(members.ids[0]), members.dhts[0].get_visible_maddrs()
    ticket = members.averagers[1].prepare_round(7, 2, admitted=members.ids)  # of a round the leader is not at
    ahead = MSGPackSerializer.dumps([1.0, 0, MSGPackSerializer.dumps(ticket)])  # as hivemind's step wraps it
    flood = MAX_HELD_PER_PEER + 8
    answers = asyncio.run(_ask_to_join(leader, maddrs, members.averagers[0].prefix, ahead, flood))
    at_once = [(s, code) for s, code in answers if s < REQUEST_TIMEOUT_S / 2]
    held = [(s, code) for s, code in answers if s >= REQUEST_TIMEOUT_S / 2]
    assert len(at_once) == flood - MAX_HELD_PER_PEER and len(held) == MAX_HELD_PER_PEER, answers
    assert all(code == averaging_pb2.PROTOCOL_VIOLATION for _, code in answers), answers  # the held: not admitted


async def _find(maddrs, node: PeerID, key: bytes, asks: int) -> list[int]:
    """`asks` finds of `key` at once from a P2P of this process: each answer's result type."""
    caller = await P2P.create(initial_peers=maddrs)
    try:
        stub = ServicerBase.get_stub.__func__(DHTProtocol, caller, node)
        request = dht_pb2.FindRequest(keys=[key])
        answers = await asyncio.gather(*(stub.rpc_find(request) for _ in range(asks)))
        return [answer.results[0].type for answer in answers]
    finally:
        await caller.shutdown()


def test_a_peer_that_asks_a_dht_node_faster_than_any_honest_one_is_answered_nothing_beyond_its_rate():
    # the DHT nodes had no per-peer rate (issue 38, point 4): each find or store was served, a store's records each
    # validated. Now a peer's finds beyond its rate are answered NOT_FOUND at once, and another peer is served
    limit_dht_requests()  # as every worker's and bootstrap node's DHT process (dht_process.HelperDHT)
    node = hivemind.DHT(start=True)
    try:
        assert node.store("limits-key", b"value", get_dht_time() + 60)
        maddrs, peer = node.get_visible_maddrs(), node.peer_id
        key = DHTID.generate(source="limits-key").to_bytes()
        flood = 2 * DHT_REQUEST_BURST
        started = time.monotonic()
        types = asyncio.run(_find(maddrs, peer, key, flood))
        elapsed = time.monotonic() - started
        found = types.count(dht_pb2.FOUND_REGULAR)
        assert found + types.count(dht_pb2.NOT_FOUND) == flood, types
        assert DHT_REQUEST_BURST <= found <= DHT_REQUEST_BURST + DHT_REQUESTS_PER_S * elapsed + 1, (found, elapsed)
        assert asyncio.run(_find(maddrs, peer, key, 1)) == [dht_pb2.FOUND_REGULAR], "another peer was refused"
    finally:
        node.shutdown()
