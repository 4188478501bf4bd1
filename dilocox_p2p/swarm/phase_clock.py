"""Where an exchange's time goes: seconds per phase, in the order they ended.

    clock = PhaseClock()
    ...                                   # phase 1: wait for the members to start the round
    clock.mark("wait")                    # the time since the last mark is the wait's
    clock.mark_split("matchmaking", "transfer", at=grouped_at)   # the step: before / after its group formed
    clock.seconds()                       # {"wait": 0.41, "matchmaking": 0.32, "transfer": 0.05, ...}

A phase marked twice (a second look for a group) adds up. Each stage's exchange of the round
applied is in `metrics.jsonl` as `exchange_phases` (README, "Metrics"): the fixed cost of an
exchange, phase by phase, is what a lean exchange has to cut (issue 37).
Phases: `wait` (the members start the round), `encode`, `matchmaking` (until the group formed),
`transfer` (the all-reduce or gather of phase 1; the compressed butterfly's parts), `phase2`
(low-rank's second exchange, its encode left in `encode`; the compressed butterfly's reduce and the
all-gather of the reduced parts), `decode`, `mend`, `borrow`, `agree` (phase 5), `other` (what no mark claimed).
"""

from __future__ import annotations

import time

__all__ = ["PhaseClock"]


class PhaseClock:
    """Wall-clock seconds of consecutive phases (time.time(): the averager stamps in its own process)."""

    def __init__(self) -> None:
        self._last = time.time()
        self._seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """`phase` ends now: it took the time since the last mark."""
        now = time.time()
        self._add(phase, now - self._last)
        self._last = now

    def mark_split(self, before: str, after: str, *, at: float | None) -> None:
        """Phases `before` and `after` end now, the first at unix time `at` (None: `before` took it all)."""
        now = time.time()
        cut = now if at is None else min(max(at, self._last), now)
        self._add(before, cut - self._last)
        if cut < now:
            self._add(after, now - cut)
        self._last = now

    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far, rounded to the millisecond, in the order the phases first ended."""
        return {phase: round(s, 3) for phase, s in self._seconds.items()}

    def _add(self, phase: str, seconds: float) -> None:
        self._seconds[phase] = self._seconds.get(phase, 0.0) + max(seconds, 0.0)
