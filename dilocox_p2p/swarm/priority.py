"""CPU priority of the swarm's helper processes.

The DHT node, its p2p daemon and the averager run beside training in their own processes.
They need little CPU, but wake up often; at training's priority each wake-up preempts a
training process, and a pipeline stage that is preempted stalls its neighbours too. Run
below training, they take the CPU training leaves idle (on a GPU cluster, nearly all of
it), which is what the one-step delay needs: the exchange has a whole round to finish.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def lower_priority(nice: int) -> None:
    """Lower the calling process's priority by `nice` levels; what it starts afterwards inherits it.

    Call first thing in a helper process, before it starts threads (on Linux, nice is per thread).
    """
    if nice <= 0:
        return
    try:
        os.nice(nice)
    except OSError as e:  # e.g. a container without permission to change priorities
        logger.warning("could not lower the priority of process %d by %d nice levels: %s", os.getpid(), nice, e)
