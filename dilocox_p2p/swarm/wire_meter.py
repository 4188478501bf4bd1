"""Every byte a stage worker moves through the swarm, read from the kernel's counters of its p2p daemon's sockets.

All of a stage's traffic with other peers goes through its p2p daemon (hivemind's go-libp2p daemon, which its
DHT node and its averager share): the exchange's parts and messages, signed requests and replies,
matchmaking, DHT lookups and stores, phase 5, mending and borrowing, state downloads, pushed records, and
libp2p's own framing and keep-alives. The exchange records count only the payload they send and receive
(protobuf message sizes: `bytes_sent`); this counts what the daemon's TCP sockets moved: Linux's tcp_info
`bytes_sent` and `bytes_received` of each (TCP payload with retransmissions, without TCP/IP headers and
pure acknowledgements, which an interface's counters add), asked of the kernel over netlink (sock_diag, as
iproute2's `ss` does; no process is started) and matched to the daemon by the socket inodes in its
/proc/PID/fd. Counted are the sockets the daemon holds and its parent does not (one its parent passed on to
it, unknowingly, when it started it, such as a socket of the pipeline's gloo process group, is not its
traffic), except the connections to the daemons of this peer's other stages (on one machine: that traffic
crosses no network). A socket that closed between two readings keeps what it had at the last one: the bytes
after that are not counted, so the stage reads the counters when each exchange ends too
(exchange_queue.ExchangeQueue), not only at its round record: peers that leave after the last exchange close
their connections before the record (the last record of a 3-peer run in CI counted nothing at first).
Where netlink or /proc cannot be read, the meter reads nothing, and the metrics say `null`.

Bytes through relays (issue 39) are counted apart: a connection relayed through another node (libp2p's circuit
relay, for peers behind NAT: `--auto-relay`, `dilocox-bootstrap --relay`) rides this daemon's own TCP connection
to that relay node, whose socket the kernel counts like any other. The relay nodes are the ones a peer started with
`--auto-relay` reserves its slots on (its initial peers: `relay_endpoints`), and any node the daemon's list of
connections names in a relayed connection's `/p2p-circuit` address (`relayed_endpoints`); every byte on a socket to
one of them is counted as "via relays" from then on, the relay node's own traffic with this one (its DHT, when it
is a bootstrap node) included: an upper bound of what was relayed, `wire_via_relays` in metrics.jsonl.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Socket", "WireMeter", "daemons_below", "fd_inodes", "read_sockets", "relay_endpoints", "relayed_connections", "relayed_endpoints"]

logger = logging.getLogger(__name__)

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_DUMP_REQUEST = 0x301  # NLM_F_REQUEST | NLM_F_DUMP
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
# struct tcp_info (linux/tcp.h): tcpi_bytes_received at 128 (Linux 4.1), tcpi_bytes_sent at 200 (Linux 4.19)
BYTES_RECEIVED_AT, BYTES_SENT_AT = 128, 200


@dataclass(frozen=True)
class Socket:
    """A TCP socket as the kernel reports it."""

    inode: int
    local: str
    remote: str
    sent: int
    received: int


def read_sockets() -> list[Socket] | None:
    """This network namespace's TCP sockets (IPv4 and IPv6) with their counters; None if netlink cannot say."""
    try:
        return [s for family in (socket.AF_INET, socket.AF_INET6) for s in _dump(family)]
    except OSError as e:
        logger.debug("sock_diag failed: %r", e)
        return None


def _dump(family: int) -> list[Socket]:
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, 0xFFFFFFFF) + bytes(48)
    header = struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_DUMP_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(5.0)
        nl.sendto(header + request, (0, 0))
        found: list[Socket] = []
        while True:
            data, offset = nl.recv(1 << 20), 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR or length < 16:
                    raise OSError("sock_diag answered with an error")
                parsed = _socket(family, data[offset + 16 : offset + length])
                if parsed is not None:
                    found.append(parsed)
                offset += (length + 3) & ~3


def _socket(family: int, body: bytes) -> Socket | None:
    """One inet_diag_msg and its attributes; None without a tcp_info that holds the byte counters."""
    if len(body) < 72:
        return None
    sport, dport = struct.unpack_from("!HH", body, 4)
    width = 4 if family == socket.AF_INET else 16
    src, dst = socket.inet_ntop(family, body[8 : 8 + width]), socket.inet_ntop(family, body[24 : 24 + width])
    inode = struct.unpack_from("=I", body, 68)[0]
    at = 72
    while at + 4 <= len(body):
        size, kind = struct.unpack_from("=HH", body, at)
        if size < 4:
            break
        if kind == INET_DIAG_INFO and size - 4 >= BYTES_SENT_AT + 8:
            info = body[at + 4 : at + size]
            (received,) = struct.unpack_from("=Q", info, BYTES_RECEIVED_AT)
            (sent,) = struct.unpack_from("=Q", info, BYTES_SENT_AT)
            return Socket(inode, f"{src}:{sport}", f"{dst}:{dport}", sent, received)
        at += (size + 3) & ~3
    return None


def fd_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds (empty if it is gone or not ours to read)."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    except OSError:
        pass
    return found


def _parent(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def daemons_below(root: int) -> set[int]:
    """The p2p daemons among the processes `root` started, and theirs (one per DHT node)."""
    from .priority import descendants

    found = set()
    for pid in descendants(root):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd":
                found.add(pid)
        except OSError:
            continue
    return found


def relayed_endpoints(connections: Iterable[tuple[str, Sequence[str]]]) -> set[str]:
    """"host:port" of the relay nodes that this daemon's relayed connections go through, as `Socket.remote` names
    them. `connections`: (peer id, multiaddrs) of each connected peer, as the daemon lists them; a relayed one's
    address is its relay's followed by /p2p-circuit, with the relay's own address or only its peer id (then its
    direct connection's address is the relay's)."""
    connections = list(connections)
    direct = {peer: [a for a in addrs if "/p2p-circuit" not in a] for peer, addrs in connections}
    found = set()
    for _, addrs in connections:
        for addr in addrs:
            if "/p2p-circuit" not in addr:
                continue
            relay = addr.split("/p2p-circuit")[0]
            endpoint = _endpoint(relay)
            if endpoint is None and "/p2p/" in relay:  # only the relay's peer id: where this daemon reaches it
                relay_id = relay.rsplit("/p2p/", 1)[1].split("/")[0]
                endpoint = next((e for a in direct.get(relay_id, ()) if (e := _endpoint(a)) is not None), None)
            if endpoint is not None:
                found.add(endpoint)
    return found


def relay_endpoints(maddrs: Iterable[str]) -> set[str]:
    """"host:port" of the relay nodes a peer started with --auto-relay reserves its slots on (its initial peers, whose
    multiaddrs name an IP: a DNS name is not matched to a socket)."""
    return {e for m in maddrs if (e := _endpoint(str(m))) is not None}


def _endpoint(maddr: str) -> str | None:
    """"host:port" of a multiaddr's /ip4|ip6/HOST/tcp/PORT part (None: it has none)."""
    parts = maddr.split("/")
    for i in range(1, len(parts) - 3):
        if parts[i] in ("ip4", "ip6") and parts[i + 2] == "tcp":
            return f"{parts[i + 1]}:{parts[i + 3]}"
    return None


async def relayed_connections(_dht: Any, node: Any) -> list[tuple[str, list[str]]]:
    """(peer id, multiaddrs) of each peer the DHT node's daemon is connected to (DHT.run_coroutine)."""
    return [(info.peer_id.to_base58(), [str(a) for a in info.addrs]) for info in await node.p2p.list_peers()]


class WireMeter:
    """Bytes sent and received by one p2p daemon's TCP sockets since the meter started, read on demand.

    `daemon`: that daemon's pid (None: not known yet); `own`: the daemons of this peer (all its stages': their
    connections to each other are not counted); `relays`: "host:port" of the relay nodes its relayed connections go
    through now (relayed_endpoints; a failure reads as none)."""

    def __init__(
        self,
        daemon: Callable[[], int | None],
        own: Callable[[], set[int]],
        read: Callable[[], list[Socket] | None] = read_sockets,
        holds: Callable[[int], set[int]] = fd_inodes,
        parent: Callable[[int], int | None] = _parent,
        relays: Callable[[], set[str]] = set,
    ):
        self._daemon, self._own, self._read, self._holds, self._parent_of = daemon, own, read, holds, parent
        self._relays = relays
        self._lock = threading.Lock()  # read at a round's record and at an exchange's end, in two threads
        self._open: dict[int, tuple[int, int]] = {}
        self._relayed: set[int] = set()  # sockets to a node that relayed a connection of this daemon (kept so)
        self._closed = (0, 0, 0, 0)  # what sockets that closed had moved at the last reading that saw them
        self._taken = (0, 0, 0, 0)

    def _counted(self) -> dict[int, tuple[int, int]] | None:
        pid = self._daemon()
        sockets = self._read() if pid is not None else None
        if pid is None or sockets is None:
            return None
        parent = self._parent_of(pid)
        mine = self._holds(pid) - (self._holds(parent) if parent is not None else set())
        others = set().union(*(self._holds(d) for d in self._own() - {pid}))
        inside = {s.local for s in sockets if s.inode in others}  # endpoints of this peer's other daemons
        counted = {s.inode: (s.sent, s.received) for s in sockets if s.inode in mine and s.remote not in inside}
        try:
            relays = self._relays()
        except Exception as e:  # noqa: BLE001 - the daemon's list is a nicety: its bytes still count as bytes
            logger.debug("could not list the relayed connections: %r", e)
            relays = set()
        self._relayed |= {s.inode for s in sockets if s.inode in counted and s.remote in relays}
        return counted

    def totals(self) -> tuple[int, int] | None:
        """(sent, received) bytes so far, or None if the counters cannot be read."""
        with self._lock:
            totals = self._totals()
            return None if totals is None else totals[:2]

    def _totals(self) -> tuple[int, int, int, int] | None:
        """(sent, received, sent via relays, received via relays) so far."""
        now = self._counted()
        if now is None:
            return None
        closed = list(self._closed)
        for inode, (s, r) in self._open.items():
            if inode not in now:  # closed since: what it had moved at the last reading stays counted
                closed[0], closed[1] = closed[0] + s, closed[1] + r
                if inode in self._relayed:
                    closed[2], closed[3] = closed[2] + s, closed[3] + r
        self._relayed &= set(now)
        self._closed, self._open = tuple(closed), now  # type: ignore[assignment]
        relayed = [now[i] for i in self._relayed]
        return (closed[0] + sum(s for s, _ in now.values()), closed[1] + sum(r for _, r in now.values()),
                closed[2] + sum(s for s, _ in relayed), closed[3] + sum(r for _, r in relayed))  # fmt: skip

    def take(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """((sent, received), (sent, received) of those via relays) since the last call (the first: since the daemon's
        sockets opened), both from one reading."""
        with self._lock:
            totals = self._totals()
            if totals is None:
                return None
            delta = tuple(t - k for t, k in zip(totals, self._taken))
            self._taken = totals
            return (delta[0], delta[1]), (delta[2], delta[3])
