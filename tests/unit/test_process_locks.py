"""A stage process forked from an interpreter that imported hivemind has hivemind's process-wide locks
of its own: a process killed while it held the inherited one cannot block it.

    pytest tests/unit/test_process_locks.py -q
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

SCENARIO = textwrap.dedent(
    """
    import multiprocessing as mp, os, signal, sys
    from hivemind.utils.mpfuture import MPFuture
    from dilocox_p2p.swarm.hivemind_patches import own_process_locks

    fork = mp.get_context("fork")

    def hold_and_die():  # killed while it writes a result: MPFuture._update_lock stays held
        MPFuture._update_lock.acquire()
        os.kill(os.getpid(), signal.SIGKILL)

    def answer(future):
        future.set_result("answered")

    def stage(reset, codes):
        if reset:
            own_process_locks()
        future = MPFuture()
        child = fork.Process(target=answer, args=(future,))  # as a stage's DHT process answers it
        child.start()
        try:
            codes.put(future.result(timeout=2))
        except TimeoutError:
            codes.put("blocked")
        child.kill()

    holder = fork.Process(target=hold_and_die)
    holder.start()
    holder.join()
    assert holder.exitcode == -signal.SIGKILL
    for reset in (False, True):
        codes = fork.SimpleQueue()
        p = fork.Process(target=stage, args=(reset, codes))
        p.start()
        p.join(20)
        print(reset, codes.get() if p.exitcode == 0 else f"exit {p.exitcode}", flush=True)
        p.kill()
    """
)


def test_a_process_that_takes_its_own_hivemind_locks_is_not_blocked_by_one_killed_holding_the_inherited_one():
    # in a subprocess: the lock this scenario leaves held would block this pytest process's own hivemind
    out = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # without its own locks the stage's first result blocks (what hung a pair of the swarm tier); with them it comes
    assert out.stdout.split("\n")[:2] == ["False blocked", "True answered"], out.stdout + out.stderr
