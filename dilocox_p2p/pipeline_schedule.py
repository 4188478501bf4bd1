"""One stage's part of a pipeline step: its micro-batches' forwards and backwards, in GPipe or 1F1B order.

Stage s receives each micro-batch's activations from stage s-1 and sends its own outputs to
stage s+1 over the peer's local process group (gloo on CPU, NCCL on CUDA); in backward, the
gradient of each received activation goes back the same way. The last stage computes the loss
of each micro-batch and backpropagates it divided by the number of micro-batches, as a peer of
one stage does (inner.py), so the gradients are those of the step's mean loss.

    schedule = PipelineSchedule(module, stage=1, n_stages=2, boundary=((4, 128, 64), torch.float32),
                                microbatches=4, order="1f1b", group=None, device=device)
    losses = schedule.step(inputs, targets)   # last stage: the micro-batch losses; others: []
    losses = schedule.eval(inputs, targets)   # forward only (call under torch.no_grad)

Every tensor between stages has one shape and dtype known in advance (`boundary`: rows of a
micro-batch x seq_len x d_model, in the stages' boundary dtype), so nothing is negotiated at
the first step. This replaces torch.distributed.pipelining's PipelineStage and schedules, which
did the same for a linear chain of stages: importing that package (torch._dynamo, DTensor, FSDP,
torch.export) took 1.6 s of one core before every peer of several stages could train, longer
than the rest of its start. Sends are asynchronous and awaited at the end of the step; receives
block, and where the schedule turns they are posted with the sends before them (`_run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

__all__ = ["PipelineSchedule", "bubble_fraction", "stage_order"]

Order = Literal["1f1b", "gpipe"]


def stage_order(order: Order, stage: int, n_stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The ("F" or "B", micro-batch) actions of one stage in a training step: GPipe runs every forward, then
    every backward; 1F1B runs as many forwards as stages follow this one, then alternates, then drains."""
    if order == "gpipe":
        return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
    warmup = min(n_stages - 1 - stage, microbatches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(microbatches - warmup, microbatches)]


def bubble_fraction(n_stages: int, microbatches: int) -> float:
    """The share of a step each stage waits idle in GPipe or 1F1B (the bubble): (S - 1) / (M + S - 1), with a
    micro-batch's forward and backward taking the same time on every stage. 1F1B holds fewer activations than
    GPipe, not a smaller bubble; more micro-batches shrink it."""
    return (n_stages - 1) / (microbatches + n_stages - 1)


class PipelineSchedule:
    """One stage of a linear pipeline: micro-batches in, activations and gradients to and from its neighbours."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        stage: int,
        n_stages: int,
        boundary: tuple[tuple[int, ...], torch.dtype],
        microbatches: int,
        order: Order,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ):
        if order not in ("1f1b", "gpipe"):
            raise ValueError(f"unknown pipeline schedule {order!r}: use 1f1b or gpipe")
        self.module, self.stage, self.n_stages = module, stage, n_stages
        self.shape, self.dtype = boundary
        self.microbatches, self.order, self.loss_fn = microbatches, order, loss_fn
        self.device, self.group = device, group
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self._prev = None if self.is_first else self._global_rank(stage - 1)
        self._next = None if self.is_last else self._global_rank(stage + 1)
        if dist.get_backend(group) == "nccl":  # NCCL: every rank takes part in a group's first call, then P2P
            dist.all_reduce(torch.zeros(1, device=device), group=group)  # among some of them may be batched

    def _global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # ----- the two steps ------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch in this schedule's order; gradients accumulate into the
        module's parameters. Returns the detached micro-batch losses on the last stage, [] elsewhere."""
        return self._run(stage_order(self.order, self.stage, self.n_stages, self.microbatches), inputs, targets)

    def eval(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Forward only, micro-batch by micro-batch (call under torch.no_grad); the last stage returns their
        losses."""
        return self._run([("F", i) for i in range(self.microbatches)], inputs, targets)

    def _run(self, actions: list[tuple[str, int]], inputs: torch.Tensor | None, targets: torch.Tensor | None) -> list:
        """Each action receives what it needs, computes, and sends. Where the schedule turns (a forward followed
        by a backward, or the reverse), an action's sends are posted in one batch with the next action's
        receives, as torch's 1F1B does: the neighbour posts the matching pair in one batch too, so NCCL, whose
        sends wait for their receiver, never has two stages each waiting to send to the other."""
        xs, ys = self._split(inputs, targets)
        kept: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # micro-batch: (its input, output or loss)
        losses: list[torch.Tensor] = []
        held: list[dist.P2POp] = []  # the last action's sends, posted with the next action's receives
        posted: list[tuple[Any, list[dist.P2POp]]] = []  # sends in flight, beside their ops (which hold the tensors)
        for n, (kind, i) in enumerate(actions):
            source = self._prev if kind == "F" else self._next
            if source is None and held:  # nothing to receive: the sends before it go alone
                posted.append(self._post(held))
                held = []
            received = None if source is None else self._receive(source, held)
            if kind == "F":
                out, sends = self._forward(i, xs[i] if self.is_first else received, ys, losses)
                kept[i] = (received, out)
            else:
                x, out = kept.pop(i)
                sends = self._backward(x, out, received)
            held = sends
            turns = n + 1 < len(actions) and actions[n + 1][0] != kind  # never at the last action: all posted
            if held and not turns:
                posted.append(self._post(held))
                held = []
        for works, _ in posted:  # not after a failure: a neighbour that failed too would never take them
            for work in works:
                work.wait()
        return losses

    # ----- one micro-batch ------------------------------------------------------------------------
    def _split(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> tuple[list, list]:
        xs = list(inputs.tensor_split(self.microbatches)) if self.is_first else []
        ys = list(targets.tensor_split(self.microbatches)) if self.is_last else []
        if self.is_first and any(x.shape[0] != self.shape[0] for x in xs):
            raise ValueError(
                f"a batch of {inputs.shape[0]} rows does not split into {self.microbatches} micro-batches of "
                f"{self.shape[0]} rows, the size every stage expects"
            )
        return xs, ys

    def _forward(
        self, i: int, x: torch.Tensor, ys: list, losses: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[dist.P2POp]]:
        """Micro-batch i's forward from its input `x` (token ids on the first stage, else received): (its output,
        or on the last stage its loss; its sends)."""
        if not self.is_first and torch.is_grad_enabled():
            x.requires_grad_()  # its gradient goes back to the stage before
        out = self.module(x)
        if self.is_last:
            loss = self.loss_fn(out, ys[i])
            losses.append(loss.detach())
            return loss, []
        return out, [dist.P2POp(dist.isend, out.detach().contiguous(), self._next, self.group)]

    def _backward(self, x: torch.Tensor | None, out: torch.Tensor, grad: torch.Tensor | None) -> list[dist.P2POp]:
        """Backward of one micro-batch from its output's gradient (the last stage: its loss, divided by the number
        of micro-batches); the sends of its input's gradient."""
        if self.is_last:
            (out / self.microbatches).backward()
        else:  # out.backward(grad) imports sympy at its first call (torch.autograd._make_grads: 0.4 s of one
            (out * grad).sum().backward()  # core); this backpropagates grad * 1, bit for bit the same gradient
        return [] if x is None else [dist.P2POp(dist.isend, x.grad.contiguous(), self._prev, self.group)]

    def _post(self, ops: list[dist.P2POp]) -> tuple[Any, list[dist.P2POp]]:
        return dist.batch_isend_irecv(ops), ops

    def _receive(self, src: int, held: list[dist.P2POp]) -> torch.Tensor:
        """One boundary tensor from `src`, received in one batch with the sends `held` (which it empties), all
        awaited here (a request is awaited once: gloo's second wait on a receive waits for another message)."""
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        works, _ = self._post([*held, dist.P2POp(dist.irecv, buffer, src, self.group)])
        held.clear()
        for work in works:
            work.wait()
        return buffer
