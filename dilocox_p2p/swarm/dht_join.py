"""Joining a DHT through its initial peers, all of them at once: the first that answers lets a node in.

hivemind joins by handing the initial peers to its p2p daemon, which dials them one after the other
at start and exits when none answers ("failed to connect to bootstrap peers": a bootstrap node
whose fellow bootstrap nodes were down could not start, and no swarm could have two first nodes),
and a peer that accepts TCP but never completes the handshake held the start 5 s wherever it stood
in the list (measured on loopback). DHTNode.create then pings them all and gives up when the first
ping *to finish* failed and the others took longer than its bootstrap timeout.

Here a node starts alone, and `join_any` dials and pings every initial peer at once: the first
answer puts each in the other's routing table, and the node walks to its own nearest nodes in the
background, as hivemind's start would. The other pings go on in the background, and whoever is
still missing is asked again every few seconds for the node's whole life (reconnect.RouteKeeper for
a peer's workers, the bootstrap node's status check for its fellows): a peer that reaches two
bootstrap nodes links them, so peers given the same initial peers end in one DHT (hivemind#624).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import selectors
import socket
import time
from collections.abc import Collection, Sequence
from typing import Any

from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from .dht_process import dht_result

__all__ = ["LISTEN_POLL_S", "PING_TIMEOUT_S", "TRY_S", "join_any", "ping_missing", "wait_until_listening"]

logger = logging.getLogger(__name__)

LISTEN_POLL_S = 0.1  # how often initial peers that do not listen yet are probed
PROBE_S = 1.0  # a TCP probe that neither connects nor is refused within this is tried again
PING_TIMEOUT_S = 5.0
TRY_S = PING_TIMEOUT_S * 2 + 1  # one try of a join: a dial and a ping, and the call into the DHT process
MAX_PINGS = 16  # at most this many missing peers are asked per look (the initial peers first)


def _tcp_targets(maddrs: Sequence[str]) -> list[tuple[str, int]] | None:
    """(host, port) of each plain-TCP multiaddr; None when one is not plain TCP (QUIC, relayed) or does not parse:
    only the DHT can tell whether that one listens."""
    targets = []
    for maddr in maddrs:
        try:
            m = Multiaddr(maddr)
            protocols = {p.name for p in m.protocols()}
            if "p2p-circuit" in protocols or "tcp" not in protocols:
                return None
            host = next(m.value_for_protocol(p) for p in ("ip4", "ip6", "dns4", "dns6", "dns") if p in protocols)
            targets.append((host, int(m.value_for_protocol("tcp"))))
        except (ValueError, StopIteration, KeyError):
            return None
    return targets


def _any_accepts(targets: list[tuple[str, int]], timeout: float) -> bool:
    """Connect to every target at once; whether one accepted within `timeout`."""
    selector, sockets = selectors.DefaultSelector(), []
    try:
        for host, port in targets:
            try:
                family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue
            sockets.append(sock)
            sock.setblocking(False)
            code = sock.connect_ex(address)
            if code == 0:
                return True
            if code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                selector.register(sock, selectors.EVENT_WRITE)
            # otherwise refused at once (loopback): its SO_ERROR is spent, so it is not watched
        deadline = time.monotonic() + timeout
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    return True
                selector.unregister(key.fileobj)  # refused: nothing listens there yet
        return False
    finally:
        selector.close()
        for sock in sockets:
            sock.close()


def wait_until_listening(maddrs: Sequence[str], *, timeout: float) -> bool:
    """Wait (at most `timeout`) until one of `maddrs` accepts a TCP connection, probing all of them at once; whether
    one did. Addresses that are not plain TCP (QUIC, relayed) are taken as listening: only the DHT can tell."""
    targets = _tcp_targets(maddrs)
    if targets is None:
        return True
    deadline = time.monotonic() + timeout
    while True:
        if _any_accepts(targets, min(PROBE_S, max(0.05, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(LISTEN_POLL_S, max(0.0, deadline - time.monotonic())))


async def ping_missing(
    _dht: Any, node: Any, initial: Sequence[str], members: Sequence[str], first: Collection[str] | None = None
) -> tuple[int, list[str]]:
    """In the DHT process: ping each of `initial` (full multiaddrs, dialed at that address) missing from the
    routing table and, if the table is empty, each of `members` (peer ids), all at once. A large swarm's members do
    not all fit in a routing table; only a node that lost every route asks them. Returns (routes before, peers
    that answered); with `first` (peer ids), as soon as one of those answered (the other pings go on in the
    background)."""
    present = _routes(node)
    targets: dict[str, list[Multiaddr]] = {}
    for text in initial:
        try:
            maddr = Multiaddr(text)
            peer = maddr.value_for_protocol("p2p")
        except Exception as e:  # noqa: BLE001 - config checked it at start; a bad one is skipped, not fatal here
            logger.debug("initial peer %s skipped: %r", text, e)
            continue
        if peer not in present and peer != node.peer_id.to_base58():
            targets.setdefault(peer, []).append(maddr.decapsulate(f"/p2p/{peer}"))
    if not present:  # lost every route; with some left, lookups find the missing members through them
        for peer in members:
            if peer != node.peer_id.to_base58():
                targets.setdefault(peer, [])

    async def ping(peer: str, maddrs: list[Multiaddr]) -> str | None:
        peer_id = PeerID.from_base58(peer)
        try:
            if maddrs:  # the daemon may not know the address (started alone, or lost the peer long ago)
                await asyncio.wait_for(node.p2p._client.connect(peer_id, maddrs), PING_TIMEOUT_S)
            answered = await asyncio.wait_for(node.protocol.call_ping(peer_id), PING_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a peer that is down or gone: asked again at the next look
            return None
        return peer if answered is not None else None

    pending = {_held(ping(peer, maddrs)) for peer, maddrs in list(targets.items())[:MAX_PINGS]}
    answered: list[str] = []
    while pending and not (first is not None and set(answered) & set(first)):
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        answered += [peer for peer in (task.result() for task in done) if peer]
    return len(present), answered


_BACKGROUND: set[asyncio.Future] = set()  # tasks a caller no longer awaits (asyncio holds tasks only weakly)


def _held(coroutine: Any) -> asyncio.Future:
    """A task of `coroutine`, held until it ends: pings left running after the first answer, and the walk."""
    task = asyncio.ensure_future(coroutine)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


async def _walk(node: Any) -> None:
    try:
        await node.find_nearest_nodes([node.node_id])
    except Exception as e:  # noqa: BLE001 - a lookup that failed: every later store or get walks again
        logger.debug("the walk to this node's nearest nodes failed: %r", e)


def _routes(node: Any) -> set[str]:
    """Peer ids in the routing table of `node` (in the DHT process)."""
    return {peer.to_base58() for peer in node.protocol.routing_table.peer_id_to_uid}


async def _join(_dht: Any, node: Any, maddrs: Sequence[str], wanted: Collection[str]) -> list[str]:
    """In the DHT process: ping all of `maddrs` until one of `wanted` (peer ids) answered; then the walk to this
    node's nearest nodes in the background (hivemind's DHTNode.create does it after its pings). One of `wanted`
    already in the routing table has joined this node: a ping of an earlier try reached it and the answer came
    too late, but its requests to this node since put it in the table (the records hivemind hands a node it has
    just met, its lookups). ping_missing asks only the missing: every later try found nobody to ask and the join
    failed although linked (CI, test_elastic's stranger, on a busy box). The others are pinged in the
    background."""
    linked = _routes(node) & set(wanted)
    if linked:
        _held(ping_missing(_dht, node, maddrs, ()))
        answered = sorted(linked)
    else:
        _, answered = await ping_missing(_dht, node, maddrs, (), first=wanted)
        if not set(answered) & set(wanted):
            return []
    _held(_walk(node))
    return answered


def join_any(dht: Any, maddrs: Sequence[str], *, timeout: float, also: Sequence[str] = ()) -> list[str]:
    """Join `dht` (a node started without initial peers) to the DHT of `maddrs` (full multiaddrs): the moment one
    of them listens, dial and ping them all, and `also` (this peer's own stage-0 node: linked, but not the swarm),
    at once; returns the peers that answered by the time one of `maddrs` did ([] if none did).
    `timeout` bounds the wait for one of `maddrs` to listen and the start of each try; a try begun in time runs to
    its own bound (a dial and a ping, PING_TIMEOUT_S each), so a busy peer's answer is not cut off by the wait:
    the whole join takes at most `timeout` plus one try. A peer whose daemon listens a moment before its DHT node
    serves fails a ping: it is asked again."""
    deadline = time.monotonic() + timeout
    wanted = tuple(Multiaddr(m).value_for_protocol("p2p") for m in maddrs)
    join = functools.partial(_join, maddrs=(*maddrs, *also), wanted=wanted)
    while True:
        if wait_until_listening(maddrs, timeout=max(0.0, deadline - time.monotonic())):
            try:
                answered = dht_result(dht, dht.run_coroutine(join, return_future=True), "joining the DHT",
                                      deadline=time.monotonic() + TRY_S)  # fmt: skip
            except TimeoutError:  # pings that took their whole time: asked again until the deadline
                answered = []
            if answered:
                return answered
        if time.monotonic() >= deadline:
            return []
        time.sleep(LISTEN_POLL_S)
