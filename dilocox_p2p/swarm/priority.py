"""CPU priority of the swarm's helper processes against training (`swarm.helper_nice`).

The DHT node, its p2p daemon and the averager run beside training in their own processes.
Where training keeps every CPU busy (CPU training with more threads than cores), helpers at
training's priority or below starve: all-reduce parts arrive late, reducers look dead and
rounds time out. So by default training runs below them (helper_nice < 0). Where cores are
to spare, the opposite is faster: each helper wake-up then preempts a pipeline stage, which
stalls its neighbours too, while helpers run below training take only idle CPU (measured in
benchmarks/overlap.py), and the one-step delay gives the exchange a whole round to finish.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def lower_priority(nice: int) -> None:
    """Lower the calling thread's priority by `nice` levels; threads and processes it starts afterwards
    inherit it (on Linux nice is per thread), so call it first thing in a helper process."""
    if nice <= 0:
        return
    try:
        os.nice(nice)
    except OSError as e:  # e.g. a container without permission to change priorities
        logger.warning("could not lower the priority of process %d by %d nice levels: %s", os.getpid(), nice, e)
