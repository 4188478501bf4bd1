"""Counted faults of one stage worker: nothing the swarm does wrong is swallowed.

Every failed lookup, check, download or refused record is logged at warning level with
its reason and counted; the stage worker hands the counts of each round to the metrics
record (`faults` in metrics.jsonl, summed over the peer's stages). A fault that repeats
with the same reason is logged the first time and then once a minute with its count, so
a bad record re-read every few seconds does not flood the log.

    faults = FaultCounter()
    faults.count("lookups_failed", "member lookup failed: %s", err)
    faults.take()   # {"lookups_failed": 1, "repairs": 0, ...} since the last take
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

__all__ = ["FAULTS", "FaultCounter", "RefusalLog"]

logger = logging.getLogger(__name__)

FAULTS = {
    "repairs": "the state was replaced because its hash differed from the stage group's majority",
    "catch_ups": "the state was replaced because this worker fell behind, was stranded or (re)joined",
    "hash_checks_skipped": "a boundary's hash check could not run (lookup failed); it is retried next round",
    "lookups_failed": "a DHT lookup of members or round records failed",
    "ties_kept": "the stage group's hashes (at a boundary) or copies of an average (in phase 5) were split evenly: "
    "no side took another's state, and nobody applied the tied average (a tie is never adopted: docs/security.md)",
    "downloads_failed": "a state or average download failed, was refused or did not match the majority",
    "records_refused": "a DHT record could not be decoded or did not belong to this run",
    "publishes_failed": "a record of this worker (heartbeat, round record) could not be stored in the DHT",
    "pending_dropped": "an average lost with a checkpoint could not be had from any member and was skipped",
    "averages_adopted": "this worker's average of a round differed from most of its group's copies before use: it took "
    "the majority's (its own with their missing spans left out, or downloaded)",
    "nonfinite_dropped": "this worker's pseudo-gradient held NaN or Inf: not sent; the group's average was taken",
    "messages_left_out": "a member's compressed message was not received or did not decode: left out of the average",
    "contributions_refused": "a member's contribution was not finite or its norm far above the group's median, or a "
    "message failed its author's signed digest: left out, and the sender struck",
    "requests_refused": "a request from another worker failed its envelope checks (signature, run, admission, replay...), "
    "or a member record it pushed did",
    "peers_banned": "a member was banned for the rest of the run after swarm.ban_after strikes",
    "steps_lost": "hivemind's averaging step of a round had not ended past its search and all-reduce deadlines: "
    "cancelled, and the group's average taken instead (exchange._step_overdue)",
    "routes_lost": "this worker's DHT node lost its route to every other node (a stopped process, a network outage); "
    "it asked its initial peers and known members again until one answered (swarm/reconnect.py)",
}
"""Every counter, with what it counts (README: metrics.jsonl)."""

_REPEAT_LOG_S = 60.0


class RefusalLog:
    """Counts refusals by kind (the reason up to its first parenthesis) for processes without a
    FaultCounter (the DHT node, the averager): `count` returns the running count when it is worth a
    log line (the 1st, 10th, 100th, 1000th, then every 10000th), else None; a flood of bad
    messages is not a flood of logs."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter()

    def count(self, reason: str) -> int | None:
        kind = reason.split(" (")[0][:80]
        self._counts[kind] += 1
        n = self._counts[kind]
        return n if n in (1, 10, 100, 1000) or n % 10000 == 0 else None

    def __getitem__(self, kind: str) -> int:
        """How many refusals of `kind` were counted."""
        return self._counts[kind]


class FaultCounter:
    """Thread-safe counts of faults since the last `take()`, each logged with its reason."""

    def __init__(self, log: logging.Logger | logging.LoggerAdapter | None = None):
        self._log = log or logger
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(FAULTS, 0)
        self._last_logged: dict[tuple[str, str], tuple[float, int]] = {}

    def count(self, name: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        """Count one `name` fault and log `message % args` at `level` (rate-limited per reason)."""
        assert name in FAULTS, f"unknown fault counter {name}"
        text = message % args if args else message
        now = time.monotonic()
        with self._lock:
            self._counts[name] += 1
            last, suppressed = self._last_logged.get((name, text), (-_REPEAT_LOG_S, 0))
            if now - last < _REPEAT_LOG_S:
                self._last_logged[(name, text)] = (last, suppressed + 1)
                return
            self._last_logged[(name, text)] = (now, 0)
        again = f" (and {suppressed} more times in the last minute)" if suppressed else ""
        self._log.log(level, "%s%s [%s]", text, again, name)

    def take(self) -> dict[str, int]:
        """The counts since the last call (every counter, zeros included)."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(FAULTS, 0)
        return counts
