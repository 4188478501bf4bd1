"""Deadlines that learn (swarm/deadlines.py): what a stage's exchanges and state downloads took sets its next
deadlines, within bounds from the configured ones (a swarm of slow links: tests/netns/test_learned_deadlines.py).

    pytest tests/unit/test_deadlines.py -q
"""

from __future__ import annotations

import pytest

from dilocox_p2p.config import ConfigError
from dilocox_p2p.config_network import SwarmConfig
from dilocox_p2p.swarm.deadlines import MARGIN, MIN_SAMPLES, WINDOW, Deadlines, SharedDeadlines

pytestmark = pytest.mark.unit

SW = SwarmConfig(allreduce_timeout=10.0, chunk_timeout=2.0, state_timeout=30.0)


def test_the_configured_deadlines_hold_until_a_few_exchanges_finished():
    d = Deadlines(SW)
    assert (d.allreduce, d.chunk, d.state) == (10.0, 2.0, 30.0)
    for _ in range(MIN_SAMPLES - 1):
        d.exchanged(1.0)
    assert d.allreduce == 10.0


def test_exchanges_slower_than_a_quarter_of_the_deadline_stretch_it_and_the_chunk_deadline_with_it():
    d = Deadlines(SW)
    for seconds in (4.0, 5.0, 6.0):
        d.exchanged(seconds)
    assert d.allreduce == MARGIN * 6.0 and d.chunk == pytest.approx(2.0 * MARGIN * 6.0 / 10.0)
    for _ in range(30):  # up to the ceiling, never past it
        d.exchanged(100.0)
    assert d.allreduce == SW.deadline_ceiling * 10.0


def test_by_default_fast_exchanges_never_shorten_a_deadline_below_the_configured_one():
    d = Deadlines(SW)
    for _ in range(10):
        d.exchanged(0.1)
    assert d.allreduce == 10.0 and d.chunk == 2.0
    fast = Deadlines(SwarmConfig(allreduce_timeout=10.0, chunk_timeout=2.0, deadline_floor=0.25))
    for _ in range(10):
        fast.exchanged(0.1)
    assert fast.allreduce == 2.5 and fast.chunk == 0.5  # the floor the operator allowed


def test_an_all_reduce_that_ran_out_doubles_the_deadline_until_one_averages_in_time():
    d = Deadlines(SW)
    d.exchange_ran_out()
    assert d.allreduce == 20.0 and d.chunk == 4.0
    d.exchange_ran_out()
    assert d.allreduce == 40.0
    for _ in range(5):
        d.exchange_ran_out()
    assert d.allreduce == SW.deadline_ceiling * 10.0  # never past the ceiling
    d.exchanged(15.0)  # it fits now: from then on MARGIN times what it took (in the lab, the first fit fell back to
    assert d.allreduce == MARGIN * 15.0  # the configured deadline until more came, and the next round ran out again)
    for _ in range(WINDOW):  # fast again: once the slow one left the window, back to the configured deadline
        d.exchanged(1.0)
    assert d.allreduce == 10.0


def test_state_downloads_teach_the_state_deadline_only():
    d = Deadlines(SW)
    for seconds in (10.0, 12.0, 11.0):
        d.downloaded(seconds)
    assert d.state == MARGIN * 12.0 and d.allreduce == 10.0


def test_fixed_deadlines_never_move():
    d = Deadlines(SwarmConfig(allreduce_timeout=10.0, chunk_timeout=2.0, deadlines="fixed"))
    for _ in range(5):
        d.exchanged(9.0), d.downloaded(50.0)
    d.exchange_ran_out()
    assert (d.allreduce, d.chunk, d.state) == (10.0, 2.0, 60.0)
    assert d.snapshot() == {"allreduce": 10.0, "chunk": 2.0, "state": 60.0}


@pytest.mark.parametrize("field, value", [("deadline_floor", 0.0), ("deadline_floor", 1.5), ("deadline_ceiling", 0.5),
                                          ("deadlines", "adaptive")])  # fmt: skip
def test_bounds_outside_their_range_are_refused_with_the_key_named(field, value):
    with pytest.raises(ConfigError, match=f"swarm.{field}"):
        SwarmConfig(**{field: value})


class _Averager(SharedDeadlines):
    def __init__(self, allreduce, chunk):
        self._init_deadlines(allreduce, chunk)
        self._allreduce_timeout, self.next_chunk_timeout = allreduce, chunk  # as hivemind's __init__ sets them


def test_the_averager_process_reads_the_deadlines_the_host_set_and_none_where_it_was_made_without():
    averager = _Averager(10.0, 2.0)
    assert averager.chunk_timeouts() == {"sender_timeout": 2.0, "reducer_timeout": 4.0}
    averager.set_deadlines(40.0, 8.0)
    assert averager._allreduce_timeout == 40.0 and averager.chunk_timeouts() == {"sender_timeout": 8.0, "reducer_timeout": 16.0}
    bare = _Averager(None, None)
    assert bare._allreduce_timeout is None and bare.chunk_timeouts() == {}
