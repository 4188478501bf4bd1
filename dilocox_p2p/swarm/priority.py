"""CPU priority of a peer's processes: its helpers against its training (`swarm.helper_nice`), and the
whole peer once it trains (`swarm.settled_nice`).

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

Start-up is the other question. A peer that starts or restarts on a machine whose cores
other peers keep busy gets its share of the CPU like any of their training processes: beside
5 busy peers on 2 cores a restart took 53 s, most of it importing torch at a tenth of a core.
So once a stage has trained and exchanged (its first round's average applied), it lowers
itself and every process it started, thread by thread, by `swarm.settled_nice` levels
(`settle`): the peers that train leave the CPU to the one that starts, and their helpers keep
their place beside their own training. On a machine with idle cores nothing changes.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

__all__ = ["descendants", "lower_priority", "settle"]

logger = logging.getLogger(__name__)


def lower_priority(nice: int, pid: int | None = None) -> bool:
    """Lower the priority of every thread of process `pid` (the calling one by default) by `nice` levels;
    False if it could not (logged for the calling process).

    On Linux nice is per thread: os.nice() alone would lower only the calling thread, and
    threads started earlier (gloo's communication threads in a stage process) would keep
    theirs and outrank the compute thread. Threads and processes started afterwards inherit.
    """
    if nice <= 0:
        return True
    me = pid is None
    pid = os.getpid() if pid is None else pid
    done = True
    for tid in _threads(pid, own=me):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
        except OSError as e:  # e.g. a container without permission to change priorities, or the thread ended
            if tid == pid or (me and tid == threading.get_native_id()):
                done = False
                if me:
                    logger.warning("could not lower the priority of process %d by %d nice levels: %s", pid, nice, e)
    return done


def settle(nice: int, *, own_session: bool = False) -> list[int]:
    """Lower this process and every process it started (children's children included) by `nice` levels,
    every thread of each, and where the peer leads its own session, that session's autogroup too; return
    the pids lowered.

    Linux shares the CPU between sessions first (autogroups, where the cpu cgroup is the root one) and by
    nice only within one: peers started as services, with setsid or by the soak each lead a session, and a
    nice of their threads alone changes nothing against each other. A peer run from a terminal shares the
    shell's session: its autogroup is left alone (it would lower the user's shell and jobs too)."""
    if nice <= 0:
        return []
    pids = [os.getpid(), *descendants(os.getpid())]
    lowered = [pid for pid in pids if lower_priority(nice, None if pid == os.getpid() else pid)]
    grouped = own_session and _lower_autogroup(nice)
    logger.info("trains now: %d process(es) of this stage run %d nice level(s) lower%s, so that a starting peer "
                "on this machine goes first (swarm.settled_nice)", len(lowered), nice,
                " and so does its session" if grouped else "")  # fmt: skip
    return lowered


def _lower_autogroup(nice: int) -> bool:
    """Set this session's autogroup nice to `nice` unless it is that low already (Linux with
    CONFIG_SCHED_AUTOGROUP; elsewhere False)."""
    path = "/proc/self/autogroup"
    try:
        with open(path) as f:
            now = int(f.read().split("nice")[1])
        if now < nice:
            with open(path, "w") as f:
                f.write(str(min(nice, 19)))
        return True
    except (OSError, ValueError, IndexError) as e:
        logger.debug("could not lower this session's autogroup: %s", e)
        return False


def descendants(pid: int) -> list[int]:
    """The processes `pid` started and theirs, as the kernel lists them (empty where /proc cannot say)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for tid in _threads(parent, own=False):
            try:
                children = [int(c) for c in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):  # the thread or process ended, or no CONFIG_PROC_CHILDREN
                continue
            new = [c for c in children if c not in found]
            found += new
            todo += new
    return found


def _threads(pid: int, *, own: bool) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:  # no /proc, or the process ended: the calling thread only, when it is the caller
        return [threading.get_native_id()] if own else []
