"""swarm/phase_clock.py: seconds per phase and the time each phase last ended.

    pytest tests/unit/test_phase_clock.py -q
"""

from __future__ import annotations

import pytest

from dilocox_p2p.swarm import phase_clock
from dilocox_p2p.swarm.phase_clock import PhaseClock

pytestmark = pytest.mark.unit


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def test_a_phase_marked_twice_adds_up_and_ends_at_its_last_mark_and_a_split_ends_its_first_part_at_the_cut(monkeypatch):
    clock = _Clock(100.0)
    monkeypatch.setattr(phase_clock, "time", clock)
    phases = PhaseClock()
    clock.now = 100.5
    phases.mark("wait")
    clock.now = 100.75
    phases.mark("encode")
    clock.now = 101.5
    phases.mark_split("matchmaking", "transfer", at=101.25)
    clock.now = 101.625
    phases.mark("encode")  # low-rank's second encode
    clock.now = 101.875
    phases.mark_split("phase2", "decode", at=None)  # no cut: the first phase took it all
    assert phases.seconds() == {"wait": 0.5, "encode": 0.375, "matchmaking": 0.5, "transfer": 0.25, "phase2": 0.25}
    assert phases.ends() == {"wait": 100.5, "encode": 101.625, "matchmaking": 101.25, "transfer": 101.5,
                             "phase2": 101.875}  # fmt: skip
