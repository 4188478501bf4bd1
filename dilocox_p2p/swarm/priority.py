"""CPU priority of the swarm's helper processes against training (`swarm.helper_nice`).

The DHT node, its p2p daemon and the averager run beside training in their own processes,
using little CPU (about 0.07 cores for 18 helper processes of 3 peers x 2 stages, measured
in network namespaces on 10 Mbit/s links). What matters is who preempts whom: with the
helpers above training, every helper wake-up preempts a pipeline stage, which stalls its
neighbours too (benchmarks/overlap.py: 0.82x of training without averaging, against 0.98x
at equal priority and 0.99x with the helpers 10 levels below, in one run). Below training,
helpers take only idle CPU, which on a machine whose cores training keeps busy can delay
all-reduce parts past their timeouts. Equal priority (0) is the default: neither starves.
Negative values lower the stage process (all its threads) below its helpers; positive values
lower the helpers, which call this first thing so that their threads and p2pd inherit it.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)


def lower_priority(nice: int) -> None:
    """Lower the priority of every thread of the calling process by `nice` levels.

    On Linux nice is per thread: os.nice() alone would lower only the calling thread, and
    threads started earlier (gloo's communication threads in a stage process) would keep
    theirs and outrank the compute thread. Threads and processes started afterwards inherit.
    """
    if nice <= 0:
        return
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
        except OSError as e:  # e.g. a container without permission to change priorities, or the thread ended
            if tid == threading.get_native_id():
                logger.warning("could not lower the priority of process %d by %d nice levels: %s", os.getpid(), nice, e)


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{os.getpid()}/task")]
    except OSError:  # pragma: no cover - no /proc: the calling thread only
        return [threading.get_native_id()]
