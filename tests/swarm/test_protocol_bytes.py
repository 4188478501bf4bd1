"""swarm/protocol_bytes.py: a stage's messages counted by what they are for, through real p2p daemons on loopback,
in the process that counts and in a process it forks after (as the DHT and the averager are).

    pytest tests/swarm/test_protocol_bytes.py -q
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import hivemind
import pytest
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import dht_pb2
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils import get_dht_time

from dilocox_p2p.swarm.protocol_bytes import SourceBytes, count_by_source
from dilocox_p2p.swarm.stream_close import END_OF_REPLY, end_replies_explicitly

pytestmark = pytest.mark.swarm

JOIN = "run_abc_s0::DilocoxAverager.rpc_join_group"
PART = "run_abc_s0::DilocoxAverager.rpc_aggregate_part"
HEADER = 1 + P2P.HEADER_LEN  # hivemind frames each message of a stream: a marker byte and its length


def _ping(size: int) -> dht_pb2.PingRequest:
    return dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"x" * size))


async def _exchange() -> tuple[int, int, int]:
    """A unary join request and a two-message stream of parts between two peers, each with its own daemon; the
    sizes of the request, of each part and of the answer."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await server.get_visible_maddrs())
    request, part, answer = _ping(1000), _ping(30_000), dht_pb2.PingResponse(available=True, dht_time=1.0)

    async def join(_: dht_pb2.PingRequest, context: P2PContext) -> dht_pb2.PingResponse:
        return answer

    async def parts(requests: AsyncIterator[dht_pb2.PingRequest], context: P2PContext):
        async for _ in requests:
            yield answer

    try:
        await server.add_protobuf_handler(JOIN, join, dht_pb2.PingRequest)
        await server.add_protobuf_handler(PART, parts, dht_pb2.PingRequest, stream_input=True, stream_output=True)

        async def two_parts():
            yield part
            yield part

        assert await client.call_protobuf_handler(server.peer_id, JOIN, request, dht_pb2.PingResponse) == answer
        replies = await client.iterate_protobuf_handler(server.peer_id, PART, two_parts(), dht_pb2.PingResponse)
        assert [r async for r in replies] == [answer, answer]
    finally:
        await client.shutdown()
        await server.shutdown()
    return request.ByteSize(), part.ByteSize(), answer.ByteSize()


def test_each_message_counts_for_its_source_on_both_ends_of_a_real_connection():
    end_replies_explicitly()  # as every stage's processes are patched (hivemind_patches.patch_for_dht_node)
    counter = SourceBytes()
    count_by_source(counter)
    request, part, answer = asyncio.run(_exchange())
    counts = counter.take()
    # both ends are in this process: each byte counts once as sent and once as received
    assert counts["matchmaking"] == [request + answer, request + answer]
    # the stream: two parts, the end of the stream (an empty message), two answers and the end of the reply
    # (stream_close.py), each framed
    end = RPCError(message=END_OF_REPLY).ByteSize()
    stream = 2 * (HEADER + part) + HEADER + 2 * (HEADER + answer) + HEADER + end
    assert counts["exchange"] == [stream, stream]
    assert set(counts) == {"matchmaking", "exchange"}
    assert counter.take() == {}  # what was taken is not counted again


def test_a_dht_forked_after_the_counter_counts_its_requests_into_it():
    counter = SourceBytes()
    count_by_source(counter)
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    second = None
    try:
        second = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(),
                              start=True)  # fmt: skip
        assert second.store("key", b"v" * 5000, get_dht_time() + 60)
        assert first.get("key", latest=True).value == b"v" * 5000
    finally:
        for dht in (second, first):
            if dht is not None:
                dht.shutdown()
    counts = counter.totals()
    sent, received = counts["dht"]
    # the value crossed once each way between the two processes (stored by one, read by the other), both counted
    assert sent >= 2 * 5000 and received >= 2 * 5000, counts
    assert all(counts[s] == (0, 0) for s in counts if s != "dht"), counts
