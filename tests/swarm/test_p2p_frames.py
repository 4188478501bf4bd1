"""A stream frame larger than any of ours is refused before its bytes are read (issue 38, point 4): two real hivemind
P2P instances (each with its own p2p daemon) on loopback, the serving one with hivemind_patches.cap_stream_frames.

    pytest tests/swarm/test_p2p_frames.py -q
"""

from __future__ import annotations

import asyncio
import resource
import time

import pytest
from hivemind.p2p import P2P, P2PContext

from dilocox_p2p.swarm.hivemind_patches import MAX_FRAME_BYTES, cap_stream_frames
from dilocox_p2p.wire import swarm_pb2

pytestmark = pytest.mark.swarm

CLOSED_WITHIN_S = 5.0
SENT_AT_MOST = 200 << 20  # what the hostile caller sends after its header, at most


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


async def _flood(declared: int) -> tuple[bool, int, int]:
    """A caller that declares a frame of `declared` bytes to a streaming handler and then sends bytes until the
    handler closes the stream (or SENT_AT_MOST, or CLOSED_WITHIN_S). Returns (closed in time, bytes sent, the
    largest growth of this process's RSS while it sent)."""
    cap_stream_frames()
    server, client = await P2P.create(), None
    received: list[swarm_pb2.Chunk] = []

    async def handler(stream, context: P2PContext):
        async for chunk in stream:
            received.append(chunk)
            yield chunk

    try:
        await server.add_protobuf_handler("frames.echo", handler, swarm_pb2.Chunk, stream_input=True, stream_output=True)
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, "frames.echo")
        baseline, grown, sent = _rss_bytes(), 0, 0
        writer.write(P2P.MESSAGE_MARKER + declared.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        block = bytes(1 << 20)
        deadline = time.monotonic() + CLOSED_WITHIN_S
        closed = False
        while time.monotonic() < deadline and sent < min(declared, SENT_AT_MOST):
            try:
                writer.write(block)
                await asyncio.wait_for(writer.drain(), 0.5)
                sent += len(block)
            except (ConnectionError, asyncio.TimeoutError):
                pass
            grown = max(grown, _rss_bytes() - baseline)
            try:  # the handler closed the stream: its end reads as EOF (or a reset) here
                if await asyncio.wait_for(reader.read(1), 0.01) == b"":
                    closed = True
                    break
            except ConnectionError:
                closed = True
                break
            except asyncio.TimeoutError:
                pass
        assert not received, "a frame too large was handed to the handler"
        return closed, sent, grown
    finally:
        if client is not None:
            await client.shutdown()
        await server.shutdown()


def test_a_declared_length_far_beyond_any_frame_is_refused_at_once_not_waited_for():
    closed, sent, _ = asyncio.run(_flood(1 << 40))
    assert closed, f"the handler still waited for a 2^40-byte frame after {sent} bytes and {CLOSED_WITHIN_S} s"


def test_a_48_mib_request_is_refused_before_it_is_buffered():
    declared = 48 << 20
    assert declared > MAX_FRAME_BYTES
    closed, sent, grown = asyncio.run(_flood(declared))
    assert closed and grown < 100 << 20, f"closed {closed} after {sent} bytes; RSS grew {grown >> 20} MiB"
