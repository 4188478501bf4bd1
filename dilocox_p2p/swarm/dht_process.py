"""The process a worker's hivemind DHT node (and its p2p daemon) runs in: niced, no call of it lost, and no
caller waiting on it for good (`dht_result`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import hivemind

from ..errors import SwarmError
from .daemon_gc import tune_daemon_gc
from .hivemind_patches import patch_for_dht_node
from .priority import lower_priority

__all__ = ["DHT_CALL_CHECK_S", "HelperDHT", "dht_result", "shutdown_whole"]

DHT_CALL_CHECK_S = 1.0  # a DHT call still running checks this often that the DHT process is alive


class HelperDHT(hivemind.DHT):
    """hivemind's DHT process (and the p2p daemon it starts), run `nice` levels below training.

    hivemind's DHT process runs each call (`get`, `store`, `run_coroutine`) as an asyncio task it keeps no
    reference to, and asyncio holds tasks only weakly: the cycle collector may destroy one that waits on a future
    nothing else holds ("Task was destroyed but it is pending!"), and the caller's future is then never answered.
    Seen in the swarm tier: a peer's `serve_hello` waited for good at its start, and the two others at the start
    barrier with it. Each call's task is held here until it ends."""

    def __init__(self, *, nice: int, **kwargs: Any):
        self.nice = nice
        patch_for_dht_node()  # before the fork: the DHT process and the averager forked later run patched
        super().__init__(**kwargs)

    def run(self) -> None:
        lower_priority(self.nice)
        tune_daemon_gc()  # this process starts the p2p daemon, with its environment
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


def dht_result(
    dht: hivemind.DHT,
    future: Any,
    what: str,
    *,
    check_s: float = DHT_CALL_CHECK_S,
    deadline: float = float("inf"),
    cancelled: Callable[[], bool] | None = None,
) -> Any:
    """The result of a call into `dht`'s process. hivemind waits for that process without a limit: if it died
    (the OOM killer, a signal sent to the whole process group), every call would hang its caller for good.
    Looks every `check_s` whether it is alive (not at all once it is known dead): SwarmError if not;
    TimeoutError past `deadline` (time.monotonic()) or once `cancelled()` (the future is then cancelled)."""
    while True:
        alive = dht.is_alive()
        try:
            return future.result(timeout=max(0.0, min(check_s if alive else 0.05, deadline - time.monotonic())))
        except TimeoutError:
            if not alive or not dht.is_alive():
                raise SwarmError(f"{what}: this worker's DHT process has died (exit code {dht.exitcode}); "
                                 "the peer cannot go on in the swarm: restart it with --resume") from None
            if time.monotonic() >= deadline or (cancelled is not None and cancelled()):
                future.cancel()
                raise


def shutdown_whole(dht: hivemind.DHT) -> None:
    """Shut `dht`'s process (and its p2p daemon) down; a SIGTERM that arrives meanwhile waits until it is done
    (its handler may raise: the process would leave them running, orphaned)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        dht.shutdown()
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
