"""Run a unit test's helper process below the swarm tier's peers in CPU priority.

CI runs the unit and swarm tiers side by side on 2 cores (pytest -n 2). A swarm test's peers lower their own
priority once they train (`swarm.settled_nice`, 10 levels), and their exchanges are timed (`chunk_timeout`).
Four processes spawned at nice 0 beside them, each importing torch, then took the cores for seconds: a reducer
starved past its chunk_timeout and a round averaged part of its coordinates (CI runs 177 and 178). A helper
process started through `niced` lowers its priority before it imports anything heavy (the target's module):

    ctx.Process(target=niced.call, args=("tests.unit.test_pipeline", "_stage_process", *args))
"""

from __future__ import annotations

import importlib
import os
from typing import Any

NICE = 19  # below the peers' settled level: a unit test beside a swarm test takes only the CPU the peers leave


def call(module: str, function: str, *args: Any) -> Any:
    """Lower this process's priority to NICE, then import `module` and call its `function(*args)`."""
    os.nice(NICE - os.nice(0))
    return getattr(importlib.import_module(module), function)(*args)
