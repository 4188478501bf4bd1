"""The queue that runs a stage worker's exchanges (exchange.py) in the background, one after another, in order."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from .. import startup
from ..average import Average, AverageKind, applies_nothing
from .exchange import RoundExchange

if TYPE_CHECKING:
    from .stage import SwarmStage

__all__ = ["ExchangeQueue"]

logger = logging.getLogger(__name__)


class ExchangeQueue:
    """Runs a stage's exchanges one at a time, in round order, in a background thread."""

    def __init__(self, stage: SwarmStage):
        self.stage = stage
        self.abandon_below = -1  # exchanges of earlier rounds are dropped (this peer caught up)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._running: RoundExchange | None = None
        self._thread = threading.Thread(target=self._run, name="exchanges", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, round: int, tensors: list[torch.Tensor], *, finite: bool = True) -> Future[Average]:
        future: Future[Average] = Future()
        self._jobs.put((future, RoundExchange(self.stage, round, tensors, finite=finite)))
        return future

    def abandon_before(self, round: int) -> None:
        """This peer jumped to round `round`: drop earlier exchanges, queued or in flight."""
        with self._lock:
            self.abandon_below = max(self.abandon_below, round)
            running = self._running
        if running is not None and running.round < round:
            # members of its group that ask this worker for the round's average are told at once that it has none
            # (they waited out their whole request for it, 10 s, while it resynced)
            self.stage.averager.mark_failed(running.round)
            running.cancel()

    def close(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=timeout)

    def _meter(self) -> None:
        """Read the stage's byte counters now, before the group's members leave and close their connections
        (wire_meter.py); a failure costs the metrics their bytes, never the exchange."""
        try:
            self.stage.wire.totals()
        except Exception as e:  # noqa: BLE001
            logger.debug("could not read the byte counters: %r", e)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, exchange = job
            startup.mark("first_exchange")
            with self._lock:
                self._running = exchange
            try:
                average = exchange.run()
                self._meter()
                self.stage.learn_deadlines(exchange.round, average)
                if average.kind.applies and average.group_size >= 2:
                    startup.mark("first_group")
                future.set_result(average)
            except Exception as e:  # never leave the outer loop hanging
                if exchange.abandoned():  # stopping: its helpers may be gone already
                    future.set_result(applies_nothing(AverageKind.ABANDONED, f"abandoned ({e!r})", 0.0))
                    continue
                logger.exception("the exchange of round %d failed unexpectedly", exchange.round)
                future.set_result(applies_nothing(AverageKind.STRANDED, f"internal error: {e!r}", 0.0))
            finally:
                with self._lock:
                    self._running = None
