"""The fp32 butterfly's reducer: hivemind's TensorPartReducer averaging each part in a fixed order, with the screens.

A reducer of the exact butterfly (allreduce.py) sums its span's parts from every sender in sender order, in float64
(`ordered_mean`: every member gets the same bits on any CPU), after leaving out a part whose norm the group's
screen refuses, scaling one above the clip, and (`direction_screen`) leaving out one that points against the
group's coordinate-wise median (average.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
from hivemind.averaging.partition import (
    AllreduceException,
    BannedException,
    TensorPartReducer,
)

from ..average import AGAINST, against_the_group, bound, norm, ordered_mean

__all__ = ["OrderedMeanReducer"]

logger = logging.getLogger(__name__)


class OrderedMeanReducer(TensorPartReducer):
    """hivemind's reducer, averaging each part in sender order (see `ordered_mean`).

    Also fixes two races seen here under CPU load when a peer dies:
    - a sender banned while its part k was already received but waiting for earlier parts is
      counted for part k (the ban covers its parts < num_parts_received), yet hivemind then
      rejects that part, so part k waits until the all-reduce times out; here it is counted;
    - a part finished twice raised InvalidStateError and broke the reducer's streams.
    """

    def __init__(self, *args: Any, max_norm_ratio: float, clip_ratio: float = 0.0, direction_screen: bool = False,
                 **kwargs: Any):  # fmt: skip
        self.max_norm_ratio, self.clip_ratio, self.direction_screen = max_norm_ratio, clip_ratio, direction_screen
        self.offenses: dict[int, str] = {}  # sender index -> why a part of it was left out (the first such)
        super().__init__(*args, **kwargs)

    def reset_accumulators(self) -> None:
        assert self.current_part_accumulated_from == self.num_current_senders or self.current_part_index == -1
        if self.current_part_index >= self.num_parts - 1:
            self.finalize()
            return
        self.current_part_index += 1
        self.current_part_accumulated_from = 0
        self.current_part_future = asyncio.Future()
        self.num_current_senders = sum(self.current_part_index < failed for failed in self.sender_failed_after)
        self.contributions: dict[int, torch.Tensor] = {}
        self.accumulator, self.denominator = None, 0.0  # unused; hivemind's finalize() deletes the attribute

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if part_index >= self.sender_failed_after[sender_index]:
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        self.contributions[sender_index] = tensor_part
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders and not self.current_part_future.done():
            norms = {i: norm(t) for i, t in self.contributions.items()}
            refused, scales = bound(norms, self.max_norm_ratio, self.clip_ratio)
            for i, reason in refused.items():
                self.offenses.setdefault(i, f"its part {self.current_part_index} {reason}")
            against = {}
            if self.direction_screen:
                flat = {i: t.reshape(-1) for i, t in self.contributions.items() if i not in refused}
                against = against_the_group({i: (lambda lo, hi, t=t: t[lo:hi]) for i, t in flat.items()},
                                            self.part_shapes[self.current_part_index].numel())  # fmt: skip
            if against:  # not struck: an honest part that is mostly noise can point against it now and then
                logger.debug("part %d: senders %s %s", self.current_part_index, sorted(against), AGAINST)
            parts = [self.contributions[i].mul(scales[i]) if i in scales else self.contributions[i]
                     for i in sorted(self.contributions) if i not in refused and i not in against]  # fmt: skip
            self.current_part_future.set_result(ordered_mean(parts, self.part_shapes[self.current_part_index]))
            self.reset_accumulators()
