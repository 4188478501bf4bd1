"""Deadlines that learn: a stage's all-reduce, chunk and state deadlines follow what its recent exchanges and state
downloads took, within bounds set from the configured ones.

Fixed deadlines are either too short for a slow link (hivemind#676: an all-reduce of a large stage over a home
uplink is cut off at `allreduce_timeout` every round, so nothing is ever averaged) or longer than a fast swarm needs
after a failure. Here, per stage:

    allreduce = clamp(max(MARGIN x the QUANTILE of the last WINDOW exchanges' seconds, grown), lo, hi)
    chunk     = chunk_timeout x allreduce / allreduce_timeout       (a link N times slower: silences N times longer)
    state     = clamp(MARGIN x the QUANTILE of the last WINDOW state downloads' seconds, lo, hi), from state_timeout

An exchange's seconds are its all-reduce's, from the group's start to its average (transfer, the second phase of
low-rank, mending), counted once it averaged (a failed one says little of the link). An fp32 all-reduce that *ran
out* (hivemind's deadline ended it while parts still came: no member fell silent for a chunk timeout) grows the
deadline: `grown` is twice the deadline that cut it, kept until an exchange averages; so a link too slow for the
configured deadline gets 2x, 4x, ... until one fits, and from then on MARGIN times what it takes (stage.py,
`learn_deadlines`: a compressed round that missed parts, or a state download that failed, leaves the same trace
as a dead member would, and grows nothing). Until MIN_SAMPLES exchanges (downloads) finished, a deadline goes no lower than
the configured one (and no lower than MARGIN times one that fitted). lo = deadline_floor x configured (1: a learned deadline never goes below the configured one; lower it to let
a fast swarm wait less after a failure, at the risk of cutting members that are merely slow for a moment: on the
CI machine all phases of all peers once ran ten times their usual length together), hi = deadline_ceiling x
configured. Deadlines are local (each member its own; the config hash leaves them out): `metrics.jsonl` records
them per round (`deadlines`).
"""

from __future__ import annotations

import collections
import ctypes
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..config_network import SwarmConfig

__all__ = ["MARGIN", "Deadlines", "SharedDeadlines"]

MARGIN = 4.0  # a deadline is this many times the slow end of what it bounds
QUANTILE = 0.9
WINDOW = 20  # recent exchanges (or state downloads) a deadline learns from
MIN_SAMPLES = 3
RAN_OUT_SHARE = 0.9  # an attempt that lasted this share of its deadline and failed ran out of it


def quantile(values: Iterable[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank, upper)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Learned:
    """One deadline: configured, learned from recent durations, grown by attempts that ran out of it."""

    def __init__(self, configured: float, lo: float, hi: float, learned: bool):
        self.configured, self.lo, self.hi, self.learned = configured, lo * configured, hi * configured, learned
        self.samples: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.grown = 0.0

    @property
    def value(self) -> float:
        if not self.learned:
            return self.configured
        if len(self.samples) >= MIN_SAMPLES:
            base = MARGIN * quantile(self.samples, QUANTILE)
        else:  # too few to go below the configured deadline, enough to stay above what one that fitted needed
            base = max([self.configured, *(MARGIN * s for s in self.samples)])
        return min(self.hi, max(self.lo, base, self.grown))

    def finished(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.grown = 0.0

    def ran_out(self) -> None:
        self.grown = min(self.hi, 2 * self.value)


class Deadlines:
    """A stage's learned deadlines (thread-safe: the exchange thread and the state taking both report to it)."""

    def __init__(self, sw: SwarmConfig):
        learned = sw.deadlines == "learned"
        self._allreduce = _Learned(sw.allreduce_timeout, sw.deadline_floor, sw.deadline_ceiling, learned)
        self._state = _Learned(sw.state_timeout, sw.deadline_floor, sw.deadline_ceiling, learned)
        self._chunk_share = sw.chunk_timeout / sw.allreduce_timeout
        self._lock = threading.Lock()

    @property
    def allreduce(self) -> float:
        """Most seconds one all-reduce (every phase of a compressed one alike) may take once its group formed."""
        with self._lock:
            return self._allreduce.value

    @property
    def chunk(self) -> float:
        """Most seconds a member may send nothing during an all-reduce (hivemind's sender timeout; its reducer
        timeout is twice it), and a reply between two of its chunks."""
        return self._chunk_share * self.allreduce

    @property
    def state(self) -> float:
        """Most seconds a state download (late join, repair) may take."""
        with self._lock:
            return self._state.value

    def exchanged(self, seconds: float) -> None:
        """An all-reduce averaged `seconds` after its group's start."""
        with self._lock:
            self._allreduce.finished(seconds)

    def exchange_ran_out(self) -> None:
        """An all-reduce was still moving when its deadline ended it: the next may take twice as long."""
        with self._lock:
            self._allreduce.ran_out()

    def downloaded(self, seconds: float) -> None:
        """A state download succeeded in `seconds`."""
        with self._lock:
            self._state.finished(seconds)

    def snapshot(self) -> dict[str, float]:
        """The deadlines now, rounded to ms, for the metrics record."""
        return {"allreduce": round(self.allreduce, 3), "chunk": round(self.chunk, 3), "state": round(self.state, 3)}


class SharedDeadlines:
    """Mixin for DilocoxAverager: the stage's deadlines, set by the host (`set_deadlines`) and read in the averager
    process where hivemind reads its own (`_allreduce_timeout`, `next_chunk_timeout`, the all-reduce's sender and
    reducer timeouts: `chunk_timeouts`); and whether the all-reduce of a round ran out of its deadline (`ran_out`)."""

    _grouped_at: float | None
    _grouped_round: int

    def _init_deadlines(self, allreduce: float | None, chunk: float | None) -> None:
        self._deadline_values = mp.Array(ctypes.c_double, [_stored(allreduce), _stored(chunk)])
        self._ran_out_round = mp.Value(ctypes.c_int64, -1)

    @property
    def _allreduce_timeout(self) -> float | None:
        return _read(self._deadline_values[0])

    @_allreduce_timeout.setter
    def _allreduce_timeout(self, value: float | None) -> None:  # hivemind's __init__ sets it
        self._deadline_values[0] = _stored(value)

    @property
    def next_chunk_timeout(self) -> float | None:
        return _read(self._deadline_values[1])

    @next_chunk_timeout.setter
    def next_chunk_timeout(self, value: float | None) -> None:
        self._deadline_values[1] = _stored(value)

    def set_deadlines(self, allreduce: float, chunk: float) -> None:
        """Host side: the deadlines of the next all-reduces and downloads."""
        self._deadline_values[0], self._deadline_values[1] = allreduce, chunk

    def chunk_timeouts(self) -> dict[str, float]:
        """hivemind's AllReduceRunner timeouts from the chunk deadline now: a sender's, and a reducer's twice it (none
        where the averager was made without one)."""
        chunk = self.next_chunk_timeout
        return {} if chunk is None else {"sender_timeout": chunk, "reducer_timeout": 2 * chunk}

    def ran_out(self, round: int) -> bool:
        """Host side: whether the all-reduce of `round` was still running when its deadline ended it."""
        return self._ran_out_round.value == round

    async def _aggregate_with_group(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super()._aggregate_with_group(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            started, limit = self._grouped_at, self._allreduce_timeout
            if started is not None and limit is not None and time.time() - started >= RAN_OUT_SHARE * limit:
                self._ran_out_round.value = self._grouped_round
            raise


def _stored(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _read(value: float) -> float | None:
    return None if math.isnan(value) else value
