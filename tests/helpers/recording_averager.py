"""An in-memory `Averager` that records what the outer loop asks of it, and when.

It stands in for the network only in ORDER tests: which round is launched with which
tensors and weight, and whether the outer loop starts round t's all-reduce before it waits
for round t-1's average. Real averaging is tested with real processes in tests/swarm/.

    averager = RecordingAverager(scale=0.5)            # the "average" is 0.5 * this peer's delta
    loop = OuterLoop(params, OuterConfig(mode="delayed"), averager)
    loop.end_round(0); loop.end_round(1)
    assert averager.events == [("launch", 0), ("launch", 1), ("wait", 0), ("resolve", 0)]

Events: ("launch", r) when all_reduce(round=r) is called; ("wait", r) each time someone
calls `.result()` on round r's future (but the streaming merge's helper thread, which reads only
futures already done); ("resolve", r) when the double sets its result.
With `resolve="on_wait"` (default) a future resolves only when first waited for, like a
network all-reduce still in flight; with `resolve="at_launch"` it is done at once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import torch

from dilocox_p2p.average import Average, AverageKind, Spans, spans_by_tensor

__all__ = ["AllReduceCall", "RecordingAverager"]


@dataclass(frozen=True)
class AllReduceCall:
    """One all_reduce call: the round and a copy of the tensors passed in."""

    round: int
    tensors: list[torch.Tensor]


class _RecordedFuture(Future):
    """A Future that reports every wait to its averager, which may resolve it then."""

    def __init__(self, averager: RecordingAverager, round: int):
        super().__init__()
        self._averager, self._round = averager, round

    def result(self, timeout: float | None = None) -> Average:
        if not threading.current_thread().name.startswith("merge-preview"):  # it reads done futures only
            self._averager.events.append(("wait", self._round))
        if not self.done():
            self._averager.resolve(self._round)
        return super().result(timeout)


class RecordingAverager:
    """Averager double: the average of round r is `scale * tensors` over `group_size` peers,
    with the coordinates in `missing` left out (zero, as the swarm hands them over)."""

    def __init__(
        self,
        *,
        scale: float = 1.0,
        group_size: int = 1,
        missing: Spans = (),
        resolve: Literal["on_wait", "at_launch"] = "on_wait",
    ):
        self.scale, self.group_size, self.missing, self.resolve_mode = scale, group_size, missing, resolve
        self.calls: list[AllReduceCall] = []
        self.events: list[tuple[str, int]] = []
        self.futures: dict[int, _RecordedFuture] = {}
        self.closed = False

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, round: int) -> Future[Average]:
        self.calls.append(AllReduceCall(round=round, tensors=[t.detach().clone() for t in tensors]))
        self.events.append(("launch", round))
        future = _RecordedFuture(self, round)
        self.futures[round] = future
        if self.resolve_mode == "at_launch":
            self.resolve(round)
        return future

    def resolve(self, round: int) -> None:
        """Set round `round`'s result: `scale` times the tensors it was launched with."""
        future = self.futures[round]
        call = next(c for c in self.calls if c.round == round)
        self.events.append(("resolve", round))
        tensors = [t * self.scale for t in call.tensors]
        for index, a, b in spans_by_tensor(self.missing, [t.numel() for t in tensors]):
            tensors[index].view(-1)[a:b] = 0
        kind = AverageKind.PARTIAL if self.missing else AverageKind.AVERAGED
        group = tuple(f"peer{i}" for i in range(self.group_size))
        future.set_result(Average(kind=kind, tensors=tensors, missing=self.missing, group=group))

    def close(self) -> None:
        self.closed = True
