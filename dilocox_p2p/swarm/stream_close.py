"""Who closes a p2p stream: the caller, once it has the handler's last message, never the handler first.

The p2p daemon (go-libp2p-daemon's doStreamPipe) answers the close of a handler's socket with Close() of the libp2p
stream, CloseRead then CloseWrite; CloseRead wakes the daemon's other goroutine, whose read then fails, and which
calls Reset(). When it does so before CloseWrite, the stream is reset instead of closed, and the caller's daemon
drops what it had received but not yet handed to the caller (yamux's Read on a reset stream). A race of two
goroutines, lost under load:
- a member of the fp32 butterfly saw a clean end after 21 (or 22, 27, 18) of a reducer's averaged parts while the
  reducer had sent all of them, mended the rest, and the round was recorded `mended`, not `averaged` (CI run 201;
  2 of 5 runs of 3 x 30 rounds of two peers beside a busy core: allreduce.py);
- a follower saw its leader's join stream end with no answer at all ("no group after 0.02 s ... StopAsyncIteration")
  while the leader had counted it in, found no group, and borrowed the round (CI run 204: group_admission.py).

So a handler whose caller closes the stream by itself once it has the last message keeps the stream open until
then (`leave_close_to_caller`); hivemind's stream handler cancels that wait when the caller's close arrives. A
caller that closes first has all it asked for, whatever its daemon does then.

A caller that reads a reply to its end (a download: an average, a state, a compressed message) cannot close first:
the end of the reply was the handler's close. So every reply now ends with an explicit END_OF_REPLY frame, after
which the handler keeps the stream open until the caller closes it (CLOSE_LINGER_S at most), and the caller closes
it as soon as that frame comes (`end_replies_explicitly`, which replaces hivemind's two sides of a protobuf stream).
A reply that ends without it was cut short on the way, and says so. Seen before: one refusal in 200 reached its
caller as a stream with nothing in it, "reply without a header" (test_allreduce's request flood, CI run 185 and
the swarm tier of 2026-12-03).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import closing, suppress
from typing import Any

__all__ = ["CLOSE_LINGER_S", "END_OF_REPLY", "CutShort", "end_replies_explicitly", "leave_close_to_caller"]

logger = logging.getLogger(__name__)
END_OF_REPLY = "dilocox: end of reply"
"""The message of the RPCError frame a handler sends after its reply's last message (hivemind's own END_OF_STREAM,
the empty RPCError, ends a caller's requests)."""


class CutShort(ConnectionError):
    """A reply stream ended without END_OF_REPLY: something on the way ended it early."""

CLOSE_LINGER_S = 10.0
"""How long a handler keeps a stream open after its last message, for the caller to close it first."""


async def leave_close_to_caller(log: logging.Logger, caller: Any, stream: str, after: str) -> None:
    """Wait (in a stream handler, after its last message) until `caller` closes `stream`, at most CLOSE_LINGER_S;
    say on `log` which side closed it (DEBUG: the caller, "`caller` closed its `stream` after `after`"; INFO: this
    side, once the wait ran out)."""
    try:
        await asyncio.sleep(CLOSE_LINGER_S)
    except asyncio.CancelledError:
        log.debug("%s closed its %s after %s", caller, stream, after)
        raise
    log.info("%s kept its %s open %.0f s after %s: closed here", caller, stream, CLOSE_LINGER_S, after)


def end_replies_explicitly() -> None:
    """Replace hivemind's P2P._add_protobuf_stream_handler and P2P._iterate_protobuf_stream_handler (1.1.11, 1.1.12)
    with `_serve_stream` and `_call_stream`, in this process and those it forks after (module docstring)."""
    from hivemind.p2p import P2P

    P2P._add_protobuf_stream_handler = _serve_stream
    P2P._iterate_protobuf_stream_handler = _call_stream


async def _serve_stream(
    self: Any, name: str, handler: Any, input_protobuf_type: type, max_prefetch: int = 5, balanced: bool = False
) -> None:
    """hivemind's handler side of a protobuf stream, but for its end: END_OF_REPLY after the handler's last message,
    then the stream left open until the caller closes it (at most CLOSE_LINGER_S)."""
    from hivemind.p2p import P2P, P2PContext
    from hivemind.proto.p2pd_pb2 import RPCError

    async def handle_stream(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=self.peer_id, remote_id=stream_info.peer_id)
        requests: asyncio.Queue = asyncio.Queue(max_prefetch)

        async def read_requests() -> AsyncIterator[Any]:
            while (request := await requests.get()) is not None:
                yield request

        async def reply() -> bool:
            """Send the handler's messages, then END_OF_REPLY; whether the caller is to close the stream."""
            try:
                async for response in handler(read_requests(), context):
                    try:
                        await P2P.send_protobuf(response, writer)
                    except Exception:  # the caller closed the stream or it broke: the caller reports it
                        logger.debug("the caller of %s went away as its reply was sent", name, exc_info=True)
                        return False
            except Exception as e:
                logger.warning("Handler failed with the exception:", exc_info=True)
                with suppress(Exception):
                    await P2P.send_protobuf(RPCError(message=str(e)), writer)
                return False
            with suppress(Exception):
                await P2P.send_protobuf(RPCError(message=END_OF_REPLY), writer)
                return True
            return False

        with closing(writer):
            replying = asyncio.create_task(reply())
            try:
                while True:
                    receive = asyncio.create_task(P2P.receive_protobuf(input_protobuf_type, reader))
                    await asyncio.wait({replying, receive}, return_when=asyncio.FIRST_COMPLETED)
                    if replying.done():  # cancelled: the handler's work was (an all-reduce its deadline ended)
                        if not replying.cancelled() and replying.result():
                            await _until_caller_closes(receive, reader, input_protobuf_type, name, stream_info.peer_id)
                        else:
                            _drop(receive)
                        return
                    try:
                        request, _ = await receive
                    except asyncio.IncompleteReadError:  # the caller closed the stream (it cancelled or died)
                        return
                    await requests.put(request)  # None for the caller's END_OF_STREAM
            except Exception:
                logger.warning("Exception while receiving requests:", exc_info=True)
            finally:
                replying.cancel()

    await self.add_binary_stream_handler(name, handle_stream, balanced=balanced)


async def _until_caller_closes(
    receive: asyncio.Task, reader: asyncio.StreamReader, input_protobuf_type: type, name: str, caller: Any
) -> None:
    """After END_OF_REPLY: wait until the caller closes the stream (what it still sends is dropped), CLOSE_LINGER_S
    at most."""
    from hivemind.p2p import P2P

    deadline = time.monotonic() + CLOSE_LINGER_S
    while (left := deadline - time.monotonic()) > 0:
        done, _ = await asyncio.wait({receive}, timeout=left)
        if not done:
            break
        try:
            receive.result()
        except Exception:  # IncompleteReadError: closed by the caller, as it should
            logger.debug("%s closed its %s stream after the end of the reply", caller, name)
            return
        receive = asyncio.create_task(P2P.receive_protobuf(input_protobuf_type, reader))
    _drop(receive)
    logger.info("%s kept its %s stream open %.0f s after the end of the reply: closed here", caller, name, CLOSE_LINGER_S)


def _drop(task: asyncio.Task) -> None:
    """Cancel `task`, or, done, take its exception (asyncio logs one never taken at ERROR)."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


async def _call_stream(self: Any, peer_id: Any, name: str, requests: Any, output_protobuf_type: type) -> AsyncIterator[Any]:
    """hivemind's caller side of a protobuf stream, but for its end: the reply ends at END_OF_REPLY, and the caller
    closes the stream then; a stream that ends without it raises CutShort."""
    from hivemind.p2p import P2P
    from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError

    _, reader, writer = await self.call_binary_stream_handler(peer_id, name)

    async def write_requests() -> None:
        async for request in requests:
            await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    async def read_replies() -> AsyncIterator[Any]:
        with closing(writer):
            try:
                while True:
                    try:
                        response, err = await P2P.receive_protobuf(output_protobuf_type, reader)
                    except asyncio.IncompleteReadError:
                        raise CutShort(f"the reply of {name} at {peer_id} ended before its end") from None
                    if err is not None and err.message == END_OF_REPLY:
                        return  # closes the stream: the handler waits for that
                    if err is not None:
                        raise P2PHandlerError(f"Failed to call handler `{name}` at {peer_id}: {err.message}")
                    yield response
            finally:
                _drop(writing)  # requests the handler no longer reads fail no reply

    writing = asyncio.create_task(write_requests())
    return read_replies()
