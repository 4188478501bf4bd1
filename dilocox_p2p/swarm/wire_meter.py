"""Every byte a stage worker moves through the swarm, read from the kernel's counters of its p2p daemon's sockets.

All of a stage's traffic with other peers goes through its p2p daemon (hivemind's go-libp2p daemon, which its
DHT node and its averager share): the exchange's parts and messages, signed requests and replies,
matchmaking, DHT lookups and stores, phase 5, mending and borrowing, state downloads, pushed records, and
libp2p's own framing and keep-alives. The exchange records count only the payload they send and receive
(protobuf message sizes: `bytes_sent`); this counts what the daemon's TCP sockets moved, `bytes_sent` and
`bytes_received` of each (Linux's tcp_info, as `ss -tinp` of iproute2 prints it: TCP payload with
retransmissions, without TCP/IP headers and pure acknowledgements, which an interface's counters add).
Counted are the sockets the daemon alone holds (one a process passed on to it, unknowingly, when it started
it, such as a socket of the pipeline's gloo process group, is not its traffic), except the connections to
the daemons of this peer's other stages (on one machine: that traffic crosses no network). A socket that
closed between two readings keeps what it had at the last one: the bytes after that are not counted. So
the stage reads the counters when each exchange ends too (exchange.ExchangeQueue), not only at its round
record: peers that leave after the last exchange close their connections before the record (the last
record of a 3-peer run in CI counted nothing at first). Without `ss` (or on a system that does not
say which process owns a socket) the meter reads nothing, and the metrics say `null`.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Socket", "WireMeter", "daemons_below", "parse_ss", "read_sockets"]

logger = logging.getLogger(__name__)

SS_TIMEOUT_S = 5.0
_OWNER = re.compile(r"pid=(\d+),")
_SENT = re.compile(r"\bbytes_sent:(\d+)")
_RECEIVED = re.compile(r"\bbytes_received:(\d+)")


@dataclass(frozen=True)
class Socket:
    """A TCP socket as `ss -tinp` shows it."""

    local: str
    remote: str
    owners: frozenset[int]
    sent: int = 0
    received: int = 0


def read_sockets() -> list[Socket] | None:
    """This machine's (this network namespace's) TCP sockets with their owners and counters; None if `ss` is
    missing or failed."""
    if shutil.which("ss") is None:
        return None
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=SS_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("ss failed: %r", e)
        return None
    return parse_ss(out)


def parse_ss(out: str) -> list[Socket]:
    """`ss -tinpH`'s output: each socket a line (state, queues, local and remote address, its owners), its
    tcp_info on the indented line after it."""
    found: list[Socket] = []
    for line in out.splitlines():
        if line and not line[0].isspace():
            fields = line.split()
            if len(fields) >= 5:
                found.append(Socket(fields[3], fields[4], frozenset(int(p) for p in _OWNER.findall(line))))
        elif found:
            sent, received = _SENT.search(line), _RECEIVED.search(line)
            last = found[-1]
            found[-1] = Socket(last.local, last.remote, last.owners, int(sent.group(1)) if sent else last.sent,
                               int(received.group(1)) if received else last.received)  # fmt: skip
    return found


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


class WireMeter:
    """Bytes sent and received by one p2p daemon's TCP sockets since the meter started, read on demand.

    `daemon`: that daemon's pid (None: not known yet); `own`: the daemons of this peer (all its stages': their
    connections to each other are not counted)."""

    def __init__(
        self,
        daemon: Callable[[], int | None],
        own: Callable[[], set[int]],
        read: Callable[[], list[Socket] | None] = read_sockets,
    ):
        self._daemon, self._own, self._read = daemon, own, read
        self._lock = threading.Lock()  # read at a round's record and at an exchange's end, in two threads
        self._open: dict[tuple[str, str], tuple[int, int]] = {}
        self._closed = (0, 0)  # what sockets that closed had moved at the last reading that saw them
        self._taken = (0, 0)

    def _counted(self) -> dict[tuple[str, str], tuple[int, int]] | None:
        pid = self._daemon()
        sockets = self._read() if pid is not None else None
        if sockets is None:
            return None
        own = self._own() | {pid}
        inside = {(s.remote, s.local) for s in sockets if s.owners & own}  # the other end is this peer's too
        return {(s.local, s.remote): (s.sent, s.received) for s in sockets
                if s.owners == {pid} and (s.local, s.remote) not in inside}  # fmt: skip

    def totals(self) -> tuple[int, int] | None:
        """(sent, received) bytes so far, or None if the counters cannot be read."""
        with self._lock:
            return self._totals()

    def _totals(self) -> tuple[int, int] | None:
        now = self._counted()
        if now is None:
            return None
        sent, received = self._closed
        for key, (s, r) in self._open.items():
            if key not in now or now[key][0] < s or now[key][1] < r:  # closed (its address pair reused since)
                sent, received = sent + s, received + r
        self._closed, self._open = (sent, received), now
        return sent + sum(s for s, _ in now.values()), received + sum(r for _, r in now.values())

    def take(self) -> tuple[int, int] | None:
        """(sent, received) bytes since the last call (the first: since the daemon's sockets opened)."""
        with self._lock:
            totals = self._totals()
            if totals is None:
                return None
            delta = (totals[0] - self._taken[0], totals[1] - self._taken[1])
            self._taken = totals
            return delta
