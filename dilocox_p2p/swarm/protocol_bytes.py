"""The bytes a stage worker's swarm traffic carries, by what it is for: the exchange, matchmaking, the DHT...

wire_meter.py counts everything the worker's p2p daemon moved through the kernel; this says what it was.
Every message of a stage goes through hivemind's client of its p2p daemon (`ControlClient`), in one of
three processes: the DHT process (DHT requests, hello), the averager process (the exchange, matchmaking,
pushes, phase 5, mending, state downloads) and the stage process itself. `count_by_source` wraps the
client's four entry points for application data (unary calls and their handlers, streams opened and
streams served) so that each message's bytes are added to its protocol's source, in shared counters that
the processes forked after it (the DHT and the averager) add to as well:

    exchange      the exchange's parts and messages, with their signed requests (rpc_aggregate_part,
                  rpc_download_message)
    matchmaking   join requests and their answers (rpc_join_group, rpc_begun_group)
    dht           DHT requests (rpc_ping, rpc_store, rpc_find): records, heartbeats, phase 5's reads
    pushes        member records pushed to the other members, and phase 5's average records to the group's
                  (rpc_push_member, rpc_push_average)
    held          averages downloaded to mend a part or borrow a round (rpc_download_average)
    state         state downloads (rpc_download_round, hivemind's rpc_download_state)
    hello         the peer handshake (hello.py)
    other         any other protocol
    own_stages    anything exchanged with this peer's other stages (their DHT nodes): it crosses no network

What the daemon adds around them (libp2p's encryption and multiplexing frames, stream negotiation,
identify, pings, keep-alives) is the wire's bytes less the sum of these (metrics.jsonl `wire_bytes` and
`wire_by_source`, own_stages left out), over a few rounds: the two are read at different moments.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

__all__ = ["NETWORK_SOURCES", "SOURCES", "SourceBytes", "count_by_source", "source_of"]

logger = logging.getLogger(__name__)

SOURCES = ("exchange", "matchmaking", "dht", "pushes", "held", "state", "hello", "other", "own_stages")
NETWORK_SOURCES = SOURCES[:-1]  # what crosses the network
_BY_METHOD = {
    "rpc_aggregate_part": "exchange", "rpc_download_message": "exchange",
    "rpc_join_group": "matchmaking", "rpc_begun_group": "matchmaking",
    "rpc_ping": "dht", "rpc_store": "dht", "rpc_find": "dht",
    "rpc_push_member": "pushes", "rpc_push_average": "pushes",
    "rpc_download_average": "held",
    "rpc_download_round": "state", "rpc_download_state": "state",
}  # fmt: skip
LOCK_WAIT_S = 1.0  # a count that cannot take the lock this long (its holder was killed) is dropped, never waited for


def source_of(protocol: str) -> str:
    """The source (SOURCES) of a libp2p protocol id: hivemind names a servicer's `[namespace::]Class.method`."""
    if protocol.startswith("dilocox.v1.Hello"):
        return "hello"
    return _BY_METHOD.get(protocol.rsplit(".", 1)[-1], "other")


class SourceBytes:
    """Bytes sent and received per source, shared by the process that makes it and those it forks after.

    `own_keys`: the folder of this peer's stage keys (`stage<k>.ed25519`, identity.worker_identity): traffic with
    a peer whose id is one of theirs counts as `own_stages`. A stage makes its key before its DHT node starts, so
    a peer is looked up there once, when it is first seen (and remembered, in each process)."""

    def __init__(self, own_keys: Path | None = None) -> None:
        self._own_keys = own_keys
        self._own: dict[str, bool] = {}
        self._counts = mp.Array(ctypes.c_longlong, 2 * len(SOURCES))  # [sent, received] per source, with a lock
        self._taken = [0] * (2 * len(SOURCES))

    def is_own(self, peer: str) -> bool:
        """Whether `peer` (base58) is one of this peer's stages."""
        if peer not in self._own:
            self._own[peer] = self._own_keys is not None and peer in _peer_ids(self._own_keys)
        return self._own[peer]

    def source(self, protocol: str, peer: str | None) -> str:
        """The source of a message of `protocol` exchanged with `peer` (base58; None: unknown)."""
        return "own_stages" if peer is not None and self.is_own(peer) else source_of(protocol)

    def add(self, source: str, sent: int, received: int) -> None:
        at = 2 * SOURCES.index(source)
        lock = self._counts.get_lock()
        if not lock.acquire(timeout=LOCK_WAIT_S):
            logger.debug("dropped a count of %d/%d bytes of %s: the counters' lock is held", sent, received, source)
            return
        try:
            self._counts[at] += sent
            self._counts[at + 1] += received
        finally:
            lock.release()

    def _snapshot(self) -> list[int]:
        with self._counts.get_lock():
            return list(self._counts)

    def totals(self) -> dict[str, tuple[int, int]]:
        """(sent, received) per source since the counters were made."""
        counts = self._snapshot()
        return {s: (counts[2 * i], counts[2 * i + 1]) for i, s in enumerate(SOURCES)}

    def take(self) -> dict[str, list[int]]:
        """[sent, received] per source since the last call, sources that moved nothing left out."""
        counts = self._snapshot()
        delta = [now - before for now, before in zip(counts, self._taken)]
        self._taken = counts
        return {s: [delta[2 * i], delta[2 * i + 1]] for i, s in enumerate(SOURCES) if delta[2 * i] or delta[2 * i + 1]}


def _peer_ids(folder: Path) -> set[str]:
    from ..identity import peer_id_of, worker_identity

    found = set()
    for path in folder.glob("stage*.ed25519"):
        try:
            found.add(peer_id_of(worker_identity(path)))
        except Exception as e:  # noqa: BLE001 - a key being written, or unreadable: not counted as own
            logger.debug("could not read stage key %s: %r", path, e)
    return found


_counter: SourceBytes | None = None


def count_by_source(counter: SourceBytes) -> None:
    """Count this process's swarm traffic (and that of the processes it forks after) into `counter`.

    Wraps hivemind's ControlClient (p2p_daemon_bindings/control.py) once per process; a later call only points
    the counts at the new counter (one stage per process)."""
    global _counter
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    _counter = counter
    if getattr(ControlClient, "_dilocox_counted", False):
        return
    ControlClient.call_unary_handler = _counted_call(ControlClient.call_unary_handler)
    ControlClient.add_unary_handler = _counted_unary_handler(ControlClient.add_unary_handler)
    ControlClient.stream_open = _counted_stream_open(ControlClient.stream_open)
    ControlClient.stream_handler = _counted_stream_handler(ControlClient.stream_handler)
    ControlClient._dilocox_counted = True


def _source(protocol: str, peer: Any) -> str | None:
    """The source of a call or stream (once each: its every message counts there); None while nothing counts."""
    if _counter is None:
        return None
    try:
        return _counter.source(protocol, peer.to_base58() if peer is not None else None)
    except Exception as e:  # noqa: BLE001 - a count is never worth a message
        logger.debug("could not tell the source of %s: %r", protocol, e)
        return None


def _add(source: str | None, sent: int, received: int) -> None:
    if _counter is not None and source is not None:
        try:
            _counter.add(source, sent, received)
        except Exception as e:  # noqa: BLE001 - a count is never worth a message
            logger.debug("could not count %d/%d bytes of %s: %r", sent, received, source, e)


def _counted_call(call: Callable[..., Awaitable[bytes]]) -> Callable[..., Awaitable[bytes]]:
    async def call_unary_handler(self: Any, peer_id: Any, proto: str, data: bytes) -> bytes:
        source = _source(proto, peer_id)
        _add(source, len(data), 0)
        response = await call(self, peer_id, proto, data)
        _add(source, 0, len(response) if response is not None else 0)
        return response

    return call_unary_handler


def _counted_unary_handler(add: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    async def add_unary_handler(
        self: Any, proto: str, handler: Callable[..., Awaitable[bytes]], *args: Any, **kwargs: Any
    ) -> None:
        async def counted(request: bytes, remote_id: Any) -> bytes:
            source = _source(proto, remote_id)
            _add(source, 0, len(request))
            response = await handler(request, remote_id)
            _add(source, len(response), 0)
            return response

        await add(self, proto, counted, *args, **kwargs)

    return add_unary_handler


def _counted_stream_open(open_: Callable[..., Awaitable[tuple[Any, Any, Any]]]) -> Callable[..., Awaitable[Any]]:
    async def stream_open(self: Any, peer_id: Any, protocols: Any) -> tuple[Any, Any, Any]:
        info, reader, writer = await open_(self, peer_id, protocols)
        source = _source(getattr(info, "proto", None) or next(iter(protocols), ""), peer_id)
        return info, _CountingReader(reader, source), _CountingWriter(writer, source)

    return stream_open


def _counted_stream_handler(register: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    async def stream_handler(
        self: Any, proto: str, handler_cb: Callable[..., Awaitable[None]], *args: Any, **kwargs: Any
    ) -> None:
        async def counted(info: Any, reader: Any, writer: Any) -> None:
            source = _source(proto, getattr(info, "peer_id", None))
            await handler_cb(info, _CountingReader(reader, source), _CountingWriter(writer, source))

        await register(self, proto, counted, *args, **kwargs)

    return stream_handler


class _CountingReader:
    """An asyncio.StreamReader whose reads count as received bytes of `source`."""

    def __init__(self, reader: asyncio.StreamReader, source: str | None):
        self._reader, self._source = reader, source

    async def readexactly(self, n: int) -> bytes:
        data = await self._reader.readexactly(n)
        _add(self._source, 0, len(data))
        return data

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        _add(self._source, 0, len(data))
        return data

    async def readline(self) -> bytes:
        data = await self._reader.readline()
        _add(self._source, 0, len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class _CountingWriter:
    """An asyncio.StreamWriter whose writes count as sent bytes of `source`."""

    def __init__(self, writer: asyncio.StreamWriter, source: str | None):
        self._writer, self._source = writer, source

    def write(self, data: bytes | bytearray | memoryview) -> None:
        _add(self._source, len(data), 0)
        self._writer.write(data)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)
