"""Routes back into the swarm's DHT after a worker lost them: a stopped process, a suspended machine, an outage.

hivemind's DHT drops a node from its routing table the first time one outgoing call to it goes
unanswered (`DHTProtocol.update_routing_table(responded=False)`), and it asks its initial peers
only once, at start. A worker whose process stood still for longer than a call's timeout (SIGSTOP,
a swapped-out or suspended machine, a cable pulled for a minute) comes back to find every call it
had in flight failed: its routing table is empty, the others dropped it too, and nothing ever
calls across again. It then trained alone for the rest of the run, reading back only its own
records, and said nothing (measured: a peer frozen for 17 s ran its last 198 rounds alone).

`RouteKeeper` looks every RECONNECT_S seconds for the peers this worker should reach and that
are missing from its routing table: its initial peers (dialed at their addresses) and, once no
route is left, the members it saw in the last FORGET_S seconds. It pings each; an answer puts the peer back in
both routing tables (hivemind adds the caller of every incoming call), and the first DHT lookup
after that finds the rest of the swarm through it. A worker that lost every route is counted
(`routes_lost`) and says when it is back.

`RouteKeeper.gone` tells which of some members are gone: their p2p daemon refuses connections
(a peer killed with SIGKILL leaves its member record behind for MEMBER_TTL_S, and the others
took it for a training member: they waited round_wait for it in matchmaking, then again for it
to start the next round). A member that the daemon reaches, or whose addresses do not answer at
all (a stopped process, a link down), is not gone: it may come back.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hivemind.p2p import PeerID

from ..errors import SwarmError
from .dht_join import MAX_PINGS, PING_TIMEOUT_S, join_any, ping_missing
from .dht_process import dht_result
from .dial import gone
from .faults import FaultCounter

__all__ = ["FORGET_S", "LEAD_JOIN_S", "RECONNECT_S", "RouteKeeper", "gone_peers", "join_lead"]

logger = logging.getLogger(__name__)

RECONNECT_S = 2.0
FORGET_S = 300.0  # a member not seen for this long is no longer asked again (it left the run)
WAIT_SLICE_S = 0.2  # how often a look waiting for the DHT process checks that the keeper is open and the process alive


LEAD_JOIN_S = 60.0  # how long a stage waits for its peer's stage 0 to answer (a start beside busy peers is slow)


def join_lead(dht: Any, lead: Sequence[str], *, timeout: float = LEAD_JOIN_S) -> None:
    """Join `dht` (a node started without initial peers) to this peer's stage 0 node at `lead` (its full
    multiaddrs): the moment that node listens, ping it (dht_join.join_any); the answer puts each node in the
    other's routing table, which is all a bootstrap would have done in a DHT of these two. So a peer without
    initial peers starts every stage's DHT node at once. SwarmError if stage 0 does not answer within `timeout`."""
    if not join_any(dht, lead, timeout=timeout):
        raise SwarmError(f"this peer's stage 0 DHT node ({' '.join(lead)}) did not answer within {timeout:.0f} s; "
                         "see its log (RUN_DIR/logs/stage0.log)")


GONE_PROBE_S = 2.0  # how long a probe of one member may take (a connection refused answers at once)


async def gone_peers(_dht: Any, node: Any, peers: Sequence[str]) -> list[str]:
    """In the DHT process: those of `peers` whose every known address refuses a connection (module docstring)."""

    async def probe(peer: str) -> str | None:
        try:
            await asyncio.wait_for(node.p2p._client.connect(PeerID.from_base58(peer), []), GONE_PROBE_S)
        except Exception as e:  # noqa: BLE001 - go-libp2p names each address and why its dial failed
            return peer if await gone(str(e)) else None
        return None

    answers = await asyncio.gather(*(probe(peer) for peer in peers[:MAX_PINGS]))
    return [peer for peer in answers if peer]


class RouteKeeper:
    """Keeps this worker's DHT node connected to the swarm (module docstring). `members`: the other members
    of the stage as last looked up, peer id -> whether it trains (a member that left cleanly said it does not)."""

    def __init__(
        self,
        dht: Any,
        *,
        initial_peers: Sequence[str],
        members: Callable[[], Mapping[str, bool]],
        faults: FaultCounter,
        period: float = RECONNECT_S,
    ):
        self.dht, self.initial_peers, self.members, self.faults, self.period = dht, list(initial_peers), members, faults, period
        self._seen: dict[str, float] = {}  # member peer id -> time.monotonic() it was last seen
        self._isolated = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dht-routes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=PING_TIMEOUT_S * 2 + 5)

    def _run(self) -> None:
        while not self._closed.wait(self.period):
            try:
                self.look()
            except Exception as e:  # noqa: BLE001 - the DHT process may be shutting down; the next look tries again
                if not self._closed.is_set() and self.dht.is_alive():
                    logger.debug("routing table check failed: %r", e)

    def gone(self, peers: Sequence[str]) -> list[str]:
        """Those of `peers` that are gone (module docstring); [] if the DHT process could not tell in time."""
        if not peers:
            return []
        try:
            return dht_result(
                self.dht, self.dht.run_coroutine(functools.partial(gone_peers, peers=tuple(peers)), return_future=True),
                "a probe of members", check_s=WAIT_SLICE_S, deadline=time.monotonic() + GONE_PROBE_S + 3,
                cancelled=self._closed.is_set,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - nothing is concluded from a probe that failed
            logger.debug("could not probe %d members: %r", len(peers), e)
            return []

    def look(self) -> list[str]:
        """One look: ask the missing peers again; the ones that answered."""
        now = time.monotonic()
        for peer, training in self.members().items():
            if training:
                self._seen[peer] = now
            else:  # joining, or left the run cleanly (its last record): no route to keep
                self._seen.pop(peer, None)
        self._seen = {p: t for p, t in self._seen.items() if now - t < FORGET_S}
        ping = functools.partial(ping_missing, initial=tuple(self.initial_peers), members=tuple(self._seen))
        # a DHT process killed with the rest of the process group never answers: the worker's exit waited out
        # the whole ping timeout for it (12-15 s per stop); a closing keeper does not wait for the pings either
        routes, answered = dht_result(
            self.dht, self.dht.run_coroutine(ping, return_future=True), "the routing table check",
            check_s=WAIT_SLICE_S, deadline=now + PING_TIMEOUT_S * 2 + 5, cancelled=self._closed.is_set,
        )  # fmt: skip
        if routes == 0 and not answered and (self.initial_peers or self._seen) and not self._isolated:
            self._isolated = True
            self.faults.count("routes_lost", "this worker's DHT node has no route to any other node, and none of its "
                              "initial peers or recent members answers (was this process stopped, the network down, "
                              "or did the other peers crash?); asking them again every %.0f s", self.period)  # fmt: skip
        elif answered and (self._isolated or routes == 0):
            self._isolated = False
            logger.warning("back in touch with the swarm's DHT through %d peers (%s)", len(answered),
                           ", ".join(p[-8:] for p in answered))  # fmt: skip
        return answered

