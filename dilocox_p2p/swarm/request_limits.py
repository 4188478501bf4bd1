"""How much one peer may ask of a worker's averager: requests a second, and requests held at once, per family.

Every handler another peer can call is limited per calling peer (its libp2p identity, which Noise authenticates)
before anything it sent is opened or checked: a request beyond the peer's rate, or beyond the most one peer may
have held at once, is refused at once and costs the worker one token-bucket lookup (issue 38, point 4). The
families have a bucket each, so that a burst of one kind never starves another (a member pushing its record is
not refused because it downloaded parts a moment before):

- "downloads": signed downloads of parts, messages, averages and states (transfer.limit_per_peer);
- "pushes": member and average records pushed to this worker (member_push.py);
- "matchmaking": requests to join this worker's group, and to learn which group began (group_admission.py);
- "parts": the fp32 butterfly's part streams (group_admission.rpc_aggregate_part).

An honest member sends a few dozen requests of any family in a round at most, and holds a handful at once (a
part or reduced part per phase, its average, a state; one join request, one part stream per group), far below
the limits. hivemind's own handlers had none: one peer's join requests naming a round ahead were each held for
most of the matchmaking's request_timeout, as many as it sent, and 300 pushed records filled the queue every
member's pushes share, so that the others' were dropped until the stage worker caught up.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "FAMILIES", "MAX_HELD_PER_PEER", "REQUESTS_PER_S", "REQUEST_BURST", "PeerLimits", "RequestRate", "peer_limits",
]  # fmt: skip

MAX_HELD_PER_PEER = 32
"""Requests of one peer, of one family, a worker holds at once (a download may wait up to its wait_s for what it
asks, a join request up to the matchmaking's request_timeout, a part stream for the all-reduce): one more is
refused at once, "busy". 10,000 waiting requests of one peer each held a coroutine polling every 50-200 ms."""
REQUESTS_PER_S = 20.0
REQUEST_BURST = 100
"""Requests of one peer, of one family, a worker takes per second on average, and at most at once after a quiet
spell (a token bucket per peer and family): one beyond is refused at once, "too many requests", before its
envelope is even checked; each refused request still costs the flooder a round trip."""
FAMILIES = ("downloads", "pushes", "matchmaking", "parts")


class RequestRate:
    """A token bucket per peer: `burst` tokens, `per_s` back a second. Peers whose bucket is full again are
    forgotten once MAX_PEERS_TRACKED are tracked (outsiders can bring any number of peer ids)."""

    MAX_PEERS_TRACKED = 4096

    def __init__(self, per_s: float = REQUESTS_PER_S, burst: int = REQUEST_BURST):
        self.per_s, self.burst = per_s, float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, when last counted)

    def take(self, peer: str) -> bool:
        """Whether `peer` may make one more request now (it is counted if so)."""
        now = time.monotonic()
        tokens = self._tokens(peer, now)
        if tokens < 1.0:
            self._buckets[peer] = (tokens, now)
            return False
        self._buckets[peer] = (tokens - 1.0, now)
        if len(self._buckets) > self.MAX_PEERS_TRACKED:
            self._buckets = {p: b for p, b in self._buckets.items() if self._tokens(p, now) < self.burst}
        return True

    def _tokens(self, peer: str, now: float) -> float:
        tokens, then = self._buckets.get(peer, (self.burst, now))
        return min(self.burst, tokens + (now - then) * self.per_s)


class PeerLimits:
    """One averager's limits: a RequestRate and a count of held requests per family."""

    def __init__(self, per_s: float = REQUESTS_PER_S, burst: int = REQUEST_BURST, max_held: int = MAX_HELD_PER_PEER):
        self.max_held = max_held
        self._rates = {family: RequestRate(per_s, burst) for family in FAMILIES}
        self._held: dict[str, collections.Counter[str]] = {family: collections.Counter() for family in FAMILIES}

    def refusal(self, family: str, peer: str) -> str:
        """Why `peer`'s next request of `family` is refused ("" if it is taken: counted against its rate)."""
        if not self._rates[family].take(peer):
            return f"too many requests: {peer} asked more than {self._rates[family].per_s:.0f} a second here ({family})"
        if self._held[family][peer] >= self.max_held:
            return f"busy: {self._held[family][peer]} requests of {peer} are held here already, the most for one peer ({family})"
        return ""

    @contextlib.contextmanager
    def held(self, family: str, peer: str) -> Iterator[None]:
        """Count a request of `peer` as held while the block runs."""
        counter = self._held[family]
        counter[peer] += 1
        try:
            yield
        finally:
            counter[peer] -= 1
            if counter[peer] <= 0:
                del counter[peer]


def peer_limits(averager: Any) -> PeerLimits:
    """The averager's PeerLimits, made in its own process at the first request (handlers run there)."""
    return averager.__dict__.setdefault("_peer_limits", PeerLimits())
