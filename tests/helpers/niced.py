"""Run a unit test's helper process below the swarm tier's peers in CPU priority.

CI runs the unit and swarm tiers side by side on 2 cores (pytest -n 2). A swarm test's peers lower their own
priority once they train (`swarm.settled_nice`, 10 levels), and their exchanges are timed (`chunk_timeout`).
Four processes spawned at nice 0 beside them, each importing torch, then took the cores for seconds: a reducer
starved past its chunk_timeout and a round averaged part of its coordinates (CI runs 177 and 178). A helper
process started through `niced` lowers its priority before it imports anything heavy (the target's module):

    ctx.Process(target=niced.call, args=("tests.unit.test_pipeline", "_stage_process", *args))

Where a test starts many such processes, `warm_context` forks them from one niced server that imported their
module (torch with it) once per pytest process: a spawned process spent 2-3 CPU-s importing torch, 17 of them
in test_pipeline (about 40 of its 46 CPU-s).
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

NICE = 19  # below the peers' settled level: a unit test beside a swarm test takes only the CPU the peers leave


def call(module: str, function: str, *args: Any) -> Any:
    """Lower this process's priority to NICE, then import `module` and call its `function(*args)`."""
    os.nice(NICE - os.nice(0))
    return getattr(importlib.import_module(module), function)(*args)


@contextlib.contextmanager
def warm_context(module: str) -> Iterator[multiprocessing.context.BaseContext]:
    """A multiprocessing context whose processes fork from a fork server started at NICE having imported `module`:
    the processes of `call(module, ...)` start without importing it again. multiprocessing keeps one fork server
    per process, started by whoever asks first and keeping what it imported: one already running (the CLI tests run
    `dilocox_p2p.launch` in this process, whose server imports the stages' modules, torch._dynamo among them) is
    stopped first, and this one when the block ends, so that neither's imports reach the other's processes."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # private (CPython 3.8+): the only way to ask for a server with other imports
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.helpers.niced_server", module])
    try:
        yield ctx
    finally:
        forkserver._forkserver._stop()
