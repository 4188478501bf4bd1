"""Whether this process was stopped: a thread that wakes every TICK_S notices when it did not run for STALL_S.

A worker that was stopped for STALL_S or more (SIGSTOP, a paused or swapped-out VM, a laptop lid) may find on
waking that every member record it held expired meanwhile, and its first lookups may find nobody: the DHT
requests that were in flight when it stopped all fail at once on waking, and hivemind drops those nodes from its
routing table. Taken at their word, such lookups say the other members left: the worker then trained alone,
round after round, ahead of the others, who took its lone state as the swarm's (churn soak, CI run 170).
Membership (membership.py, STALL_GRACE_S) does not take a lookup that lost every other member as their departure
for a while after a stall, nor suspect the members whose parts its all-reduce missed meanwhile: its own timers
ran out, not their parts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["STALL_S", "TICK_S", "StallWatch"]

logger = logging.getLogger(__name__)

TICK_S = 0.25
# a thread that wakes every TICK_S and did not run for this long: the process was stopped (a heartbeat, HEARTBEAT_S:
# a member's records only expire from a view after a longer stop; a thread starved of CPU that long on a loaded
# machine is rare, and is taken for a stop)
STALL_S = 5.0


class StallWatch:
    """Notices, within TICK_S of waking, that this process did not run for `stall_s` seconds or more."""

    def __init__(self, *, tick_s: float = TICK_S, stall_s: float = STALL_S):
        self.tick_s, self.stall_s = tick_s, stall_s
        self._lock = threading.Lock()
        self._woke_at = float("-inf")  # time.monotonic() at which the last stall was noticed
        self.stalls = 0
        self.on_stall: Callable[[float], None] | None = None  # called in the watch's thread with the stall's length
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.tick_s + 1.0)

    def since_stall(self) -> float:
        """Seconds since the last stall was noticed (infinite if none was)."""
        with self._lock:
            return time.monotonic() - self._woke_at

    def _run(self) -> None:
        last = time.monotonic()
        while not self._closed.wait(self.tick_s):
            now = time.monotonic()
            stalled = now - last - self.tick_s
            if stalled >= self.stall_s:
                with self._lock:
                    self._woke_at, self.stalls = now, self.stalls + 1
                logger.warning("this process did not run for %.1f s (stopped, or starved of CPU)", stalled)
                if self.on_stall is not None:
                    self.on_stall(stalled)
            last = now
