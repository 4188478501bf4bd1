"""A process's connection to its p2p daemon outlives a call cancelled as its reply came in, and a streamed reply
ends explicitly, its caller closing the stream (stream_close.py): two real hivemind P2P instances (each with its own
p2p daemon) on loopback.

    pytest tests/swarm/test_p2p_replies.py -q
"""

from __future__ import annotations

import asyncio
import logging
import select
import threading
import time

import pytest
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import dht_pb2

from dilocox_p2p.swarm.hivemind_patches import guard_unary_replies
from dilocox_p2p.swarm.stream_close import CLOSE_LINGER_S, CutShort, end_replies_explicitly

pytestmark = pytest.mark.swarm

REPLY_AFTER_S = 0.2
WAIT_S = 10.0


def _serve(ready: list, asked: threading.Event, replied: threading.Event, stop: threading.Event) -> None:
    """The answering peer, in a thread with an event loop of its own: it must answer while the caller's stands still."""

    async def main() -> None:
        p2p = await P2P.create()

        async def ping(request: dht_pb2.PingRequest, context: P2PContext) -> dht_pb2.PingResponse:
            asked.set()
            await asyncio.sleep(REPLY_AFTER_S)
            replied.set()
            return dht_pb2.PingResponse(available=True)

        await p2p.add_protobuf_handler("ping", ping, dht_pb2.PingRequest)
        ready.append((p2p.peer_id, await p2p.get_visible_maddrs()))
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await p2p.shutdown()

    asyncio.run(main())


async def _cancel_as_the_reply_is_read(caller: P2P, call, asked: threading.Event, replied: threading.Event) -> None:
    """Cancel a unary call in the very turn of the event loop in which its reply is read from the daemon's
    connection: once the other peer has the request, this loop stands still until the reply's bytes wait in the
    socket, and the cancelling timer, due by then, runs right after that read (asyncio handles a turn's I/O
    events before its timers)."""
    loop = asyncio.get_running_loop()
    # the connection's socket: a local of hivemind's reader task (ControlClient keeps no reference to it)
    reader = caller._client.control._read_task.get_coro().cr_frame.f_locals["reader"]
    sock = reader._transport.get_extra_info("socket")
    task = asyncio.create_task(call())
    deadline = time.monotonic() + WAIT_S
    while not asked.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert replied.wait(WAIT_S), "the other peer never answered"
    assert select.select([sock], [], [], WAIT_S)[0], "the reply never reached this process's daemon connection"
    loop.call_at(loop.time() - 1, task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_reply_to_a_call_cancelled_as_it_arrives_leaves_the_daemon_connection_answering(caplog):
    # hivemind's reader of the connection set the cancelled call's result, raised InvalidStateError and stopped:
    # every later call of that process timed out and no request to it was answered (a DHT process lost every route)
    guard_unary_replies()
    caplog.set_level(logging.DEBUG, logger="dilocox_p2p.swarm.hivemind_patches")
    ready: list = []
    asked, replied, stop = threading.Event(), threading.Event(), threading.Event()
    server = threading.Thread(target=_serve, args=(ready, asked, replied, stop), daemon=True)
    server.start()

    async def main() -> None:
        deadline = time.monotonic() + WAIT_S
        while not ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        peer, maddrs = ready[0]
        caller = await P2P.create(initial_peers=[f"{m}/p2p/{peer}" for m in maddrs])

        def ping():
            return caller.call_protobuf_handler(peer, "ping", dht_pb2.PingRequest(), dht_pb2.PingResponse)

        try:
            assert (await asyncio.wait_for(ping(), WAIT_S)).available
            asked.clear()
            replied.clear()
            await _cancel_as_the_reply_is_read(caller, ping, asked, replied)
            try:
                assert (await asyncio.wait_for(ping(), WAIT_S)).available
            except asyncio.TimeoutError:
                pytest.fail("the connection no longer answers: its reader ended at the cancelled call's reply")
            assert "came after the call ended" in caplog.text, "the reply was not read after its call was cancelled"
        finally:
            await caller.shutdown()

    try:
        asyncio.run(main())
    finally:
        stop.set()
        server.join(timeout=WAIT_S)


async def _pair() -> tuple[P2P, P2P]:
    """Two real P2P instances (two p2p daemons) on loopback, the second connected to the first."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = await server.get_visible_maddrs()
    caller = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[f"{m}/p2p/{server.peer_id}" for m in maddrs])
    return server, caller


def test_a_streamed_reply_ends_with_its_end_frame_and_its_caller_closes_the_stream_first(caplog):
    # a handler that closed its stream after its last message had it reset now and then on the way, and the caller's
    # daemon dropped what it had not handed on: one refused request in 200 read as a stream with nothing in it
    # (test_allreduce's flood). The reply now ends with END_OF_REPLY; its caller closes the stream as that comes, and
    # the handler, which kept it open until then, says so
    end_replies_explicitly()
    caplog.set_level(logging.DEBUG, logger="dilocox_p2p.swarm.stream_close")

    async def main() -> None:
        server, caller = await _pair()

        async def count(request: dht_pb2.PingRequest, context: P2PContext):
            for _ in range(3):
                yield dht_pb2.PingResponse(available=True)

        try:
            await server.add_protobuf_handler("count", count, dht_pb2.PingRequest, stream_output=True)
            started = time.monotonic()
            replies = [r async for r in await caller.iterate_protobuf_handler(
                server.peer_id, "count", dht_pb2.PingRequest(), dht_pb2.PingResponse)]  # fmt: skip
            assert len(replies) == 3 and all(r.available for r in replies)
            assert time.monotonic() - started < CLOSE_LINGER_S / 2  # it did not wait for the handler's close
            deadline = time.monotonic() + WAIT_S
            while "closed its count stream after the end of the reply" not in caplog.text and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert "closed its count stream after the end of the reply" in caplog.text, caplog.text[-2000:]
        finally:
            await caller.shutdown()
            await server.shutdown()

    asyncio.run(main())


def test_a_reply_stream_that_ends_before_its_end_frame_is_cut_short_not_complete():
    # a stream ended on the way (a reset, a handler process that died) read as a complete reply, shorter: now it raises
    end_replies_explicitly()

    async def main() -> None:
        server, caller = await _pair()

        async def one_then_close(stream_info, reader, writer) -> None:  # a handler side that ends without its end frame
            await P2P.receive_protobuf(dht_pb2.PingRequest, reader)
            await P2P.send_protobuf(dht_pb2.PingResponse(available=True), writer)
            writer.close()

        try:
            await server.add_binary_stream_handler("cut", one_then_close)
            stream = await caller.iterate_protobuf_handler(server.peer_id, "cut", dht_pb2.PingRequest(), dht_pb2.PingResponse)
            got = []
            with pytest.raises(CutShort):
                async for reply in stream:
                    got.append(reply)
            assert len(got) == 1
        finally:
            await caller.shutdown()
            await server.shutdown()

    asyncio.run(main())
