"""Waits driven by a condition, bounded: tests wait for an event (a record, a group, a count), not for a time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout: float, message: Callable[[], str], *, every: float = 0.2) -> None:
    """Poll `condition` every `every` seconds until it holds; fail with `message()` once `timeout` has passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message()
        time.sleep(every)
