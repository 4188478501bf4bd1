"""The process a worker's hivemind DHT node (and its p2p daemon) runs in: niced, and no call of it lost."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import hivemind

from .hivemind_patches import cap_stream_frames, guard_unary_replies
from .priority import lower_priority

__all__ = ["HelperDHT"]


class HelperDHT(hivemind.DHT):
    """hivemind's DHT process (and the p2p daemon it starts), run `nice` levels below training.

    hivemind's DHT process runs each call (`get`, `store`, `run_coroutine`) as an asyncio task it keeps no
    reference to, and asyncio holds tasks only weakly: the cycle collector may destroy one that waits on a future
    nothing else holds ("Task was destroyed but it is pending!"), and the caller's future is then never answered.
    Seen in the swarm tier: a peer's `serve_hello` waited for good at its start, and the two others at the start
    barrier with it. Each call's task is held here until it ends."""

    def __init__(self, *, nice: int, **kwargs: Any):
        self.nice = nice
        guard_unary_replies()  # before the fork: the DHT process and the averager forked later run the guarded reader
        cap_stream_frames()  # ... and refuse a stream frame too large to be one of ours before reading it
        super().__init__(**kwargs)

    def run(self) -> None:
        lower_priority(self.nice)
        super().run()

    async def _get(self, *args: Any, **kwargs: Any) -> None:
        with _held_task():
            await super()._get(*args, **kwargs)

    async def _store(self, *args: Any, **kwargs: Any) -> None:
        with _held_task():
            await super()._store(*args, **kwargs)

    async def _run_coroutine(self, *args: Any, **kwargs: Any) -> None:
        with _held_task():
            await super()._run_coroutine(*args, **kwargs)


_HELD_TASKS: set[asyncio.Task] = set()  # the DHT process's calls in flight (HelperDHT)


@contextlib.contextmanager
def _held_task() -> Iterator[None]:
    task = asyncio.current_task()
    if task is not None:
        _HELD_TASKS.add(task)
    try:
        yield
    finally:
        _HELD_TASKS.discard(task)  # type: ignore[arg-type]
