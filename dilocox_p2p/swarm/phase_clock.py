"""Where an exchange's time goes: seconds per phase, in the order they ended.

    clock = PhaseClock()
    ...                                   # phase 1: wait for the members to start the round
    clock.mark("wait")                    # the time since the last mark is the wait's
    clock.mark_split("matchmaking", "transfer", at=grouped_at)   # the step: before / after its group formed
    clock.seconds()                       # {"wait": 0.41, "matchmaking": 0.32, "transfer": 0.05, ...}
    clock.ends()                          # {"wait": 1764755000.412, ...}: unix time each phase last ended

A phase marked twice (a second look for a group, low-rank's second encode) adds up, and its end is
the last. Each stage's exchange of the round applied is in `metrics.jsonl` as `exchange_phases`
and `exchange_phase_ends` (README, "Metrics"): the fixed cost of an exchange, phase by phase, is
what a lean exchange has to cut (issue 37), and the members' ends of one phase, side by side, show
how long the first waited for the last at that step (benchmarks/butterfly_bytes.py).
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
        self._ends: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """`phase` ends now: it took the time since the last mark."""
        now = time.time()
        self._add(phase, now - self._last, end=now)
        self._last = now

    def mark_split(self, before: str, after: str, *, at: float | None) -> None:
        """Phases `before` and `after` end now, the first at unix time `at` (None: `before` took it all)."""
        now = time.time()
        cut = now if at is None else min(max(at, self._last), now)
        self._add(before, cut - self._last, end=cut)
        if cut < now:
            self._add(after, now - cut, end=now)
        self._last = now

    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far, rounded to the millisecond, in the order the phases first ended."""
        return {phase: round(s, 3) for phase, s in self._seconds.items()}

    def ends(self) -> dict[str, float]:
        """Unix time each phase last ended, to the millisecond, in the order the phases first ended."""
        return {phase: round(t, 3) for phase, t in self._ends.items()}

    def _add(self, phase: str, seconds: float, *, end: float) -> None:
        self._seconds[phase] = self._seconds.get(phase, 0.0) + max(seconds, 0.0)
        self._ends[phase] = end
