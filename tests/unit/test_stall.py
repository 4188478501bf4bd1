"""A process knows it was stopped (swarm/stall.py): its watch notices a SIGSTOP at the first tick after SIGCONT."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

STALL_PY = Path(__file__).resolve().parents[2] / "dilocox_p2p" / "swarm" / "stall.py"
WATCHER = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("stall", {str(STALL_PY)!r})  # the module alone: no torch to import
stall = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stall)
StallWatch = stall.StallWatch
watch = StallWatch(tick_s=0.05, stall_s=1.0)  # the default (5 s) scaled down
watch.on_stall = lambda seconds: print(f"stalled {{seconds:.2f}} {{watch.since_stall():.2f}}", flush=True)
watch.start()
print("watching", flush=True)
time.sleep(float(sys.argv[1]))
print(f"done {{watch.stalls}}", flush=True)
"""


def _line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line within {timeout} s"
    return proc.stdout.readline().strip()


def test_a_process_stopped_for_two_seconds_notices_it_at_once_when_it_runs_again_and_not_before():
    proc = subprocess.Popen([sys.executable, "-c", WATCHER, "3.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert _line(proc, 60) == "watching"
        time.sleep(0.3)  # ticking, never stopped: nothing to say
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.0)
        woke = time.monotonic()
        proc.send_signal(signal.SIGCONT)
        said, seconds, since = _line(proc, 5).split()
        assert said == "stalled" and 1.8 <= float(seconds) <= 4.0 and float(since) < 0.5
        assert time.monotonic() - woke < 1.0  # told within a tick or so of waking
        assert _line(proc, 10) == "done 1"
    finally:
        proc.kill()
        proc.wait(10)


def test_a_watch_that_keeps_running_never_reports_a_stall():
    proc = subprocess.run([sys.executable, "-c", WATCHER, "1.0"], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split("\n")[:2] == ["watching", "done 0"], proc.stdout + proc.stderr
