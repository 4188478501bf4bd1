"""Outer loop of one stage worker: pseudo-gradient, Nesterov outer step, one-step delay.

DiLoCo: https://arxiv.org/abs/2311.08105   DiLoCoX: https://arxiv.org/abs/2506.21263

State (all on CPU, all for this stage only: the other half of the dual optimizer policy):
theta_g, the outer momentum, and in `delayed` mode the pending average of the last round.

    round t:  theta_local <- theta_g; H inner steps
              delta_t = theta_g - theta_local
              start all-reduce of delta_t                  -> Delta_t (a future)
              sync:    wait Delta_t,     theta_g <- nesterov(theta_g, Delta_t)
              delayed: wait Delta_{t-1}, theta_g <- nesterov(theta_g, Delta_{t-1})

Invariant: peers that applied the same averages hold bit-identical theta_g; `state_hash`
proves it. The all-reduce plugs in through `Averager`: one call per round, returning a
future of the average. `LocalAverager` is the average over a group of one.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from .config import OuterConfig

__all__ = [
    "Averager",
    "AveragingResult",
    "LocalAverager",
    "OuterLoop",
    "OuterNesterov",
    "RoundOutcome",
    "pseudo_gradient",
    "state_hash",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AveragingResult:
    """The average of one round's pseudo-gradients over a group of peers."""

    tensors: list[torch.Tensor]
    group_size: int
    bytes_sent: int = 0
    bytes_received: int = 0
    coverage: float = 1.0
    """Share of the coordinates averaged over the whole group (1.0 unless a reducer failed)."""
    peers: tuple[str, ...] = ()
    note: str = ""
    """Why the group is smaller than hoped (e.g. no partner found), for the log."""
    window: tuple[float, float] | None = None
    """Wall-clock (unix) start and end of the network exchange, when there was one."""
    fallback: bool = False
    """Other workers were expected but no group formed: this is the local delta alone."""


class Averager(Protocol):
    """The seam between the outer loop and the network: one all-reduce per round."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, round: int, weight: float) -> Future[AveragingResult]:
        """Start averaging `tensors` (this peer's pseudo-gradient of `round`) with the stage group.

        The tensors belong to the averager from now on. The future resolves to the average;
        it never raises for network trouble: a round nobody else joined is averaged over a
        group of one.
        """
        ...

    def close(self) -> None: ...


class LocalAverager:
    """The average over a group of one: this peer alone."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, round: int, weight: float) -> Future[AveragingResult]:
        future: Future[AveragingResult] = Future()
        future.set_result(AveragingResult(tensors=list(tensors), group_size=1))
        return future

    def close(self) -> None:
        pass


def pseudo_gradient(theta_g: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """delta = theta_g - theta_local, on CPU in fp32."""
    return [g - p.detach().to("cpu", torch.float32) for g, p in zip(theta_g, params)]


def state_hash(tensors: Sequence[torch.Tensor]) -> str:
    """Hex SHA-256 of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class OuterNesterov:
    """Nesterov momentum on theta_g with the averaged pseudo-gradient as the gradient.

    Same update as torch.optim.SGD(nesterov=True): buf = mu*buf + Delta;
    theta_g -= lr * (Delta + mu*buf).
    """

    def __init__(self, theta_g: Sequence[torch.Tensor], *, lr: float, momentum: float):
        self.theta_g, self.lr, self.momentum = list(theta_g), lr, momentum
        self.buffers = [torch.zeros_like(t) for t in self.theta_g]

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor]) -> None:
        mu = self.momentum
        for theta, buf, d in zip(self.theta_g, self.buffers, delta):
            buf.mul_(mu).add_(d)
            theta.sub_(d.add(buf, alpha=mu), alpha=self.lr)


@dataclass
class RoundOutcome:
    """What the outer step at the end of a round did."""

    applied_round: int | None  # whose average was applied (t in sync, t-1 in delayed, None at round 0)
    group_size: int | None = None  # None when nothing was applied
    seconds_wait: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    coverage: float = 1.0
    peers: tuple[str, ...] = ()
    allreduce_window: tuple[float, float] | None = None  # unix start/end of the applied all-reduce
    fallback: bool = False  # the applied "average" is the local delta because no group formed


@dataclass
class _Pending:
    round: int
    future: Future[AveragingResult]


class OuterLoop:
    """theta_g, the outer optimizer and the pending average for one stage."""

    def __init__(self, params: Sequence[torch.Tensor], cfg: OuterConfig, averager: Averager):
        self.params = list(params)
        self.mode = cfg.mode
        self.averager = averager
        self.theta_g = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.optimizer = OuterNesterov(self.theta_g, lr=cfg.effective_lr, momentum=cfg.momentum)
        self.pending: _Pending | None = None
        self.boundary = 0  # rounds completed: theta_g is theta_g(boundary)
        self.missing_pending: int | None = None  # set when restored without the average still in flight
        self.lock = threading.RLock()  # held while theta_g changes, so a copy served to a peer is consistent

    @torch.no_grad()
    def load_into_model(self) -> None:
        """theta_local <- theta_g."""
        for p, g in zip(self.params, self.theta_g):
            p.copy_(g)

    def end_round(self, round: int, *, weight: float) -> RoundOutcome:
        """Compute delta_round, start its all-reduce, apply the average this mode applies now."""
        delta = pseudo_gradient(self.theta_g, self.params)
        launched = _Pending(round, self.averager.all_reduce(delta, round=round, weight=weight))
        to_apply = launched if self.mode == "sync" else self.pending
        return self._apply(to_apply, keep=None if self.mode == "sync" else launched, boundary=round + 1)

    def drain(self) -> RoundOutcome | None:
        """Apply the average still pending (delayed mode), e.g. at the end of the run."""
        if self.pending is None:
            return None
        return self._apply(self.pending, keep=None, boundary=self.boundary)

    def _apply(self, pending: _Pending | None, *, keep: _Pending | None, boundary: int) -> RoundOutcome:
        """Wait for `pending` (outside the lock), then step theta_g, keep `keep` pending, move the boundary."""
        started = time.perf_counter()
        result = pending.future.result() if pending is not None else None
        waited = time.perf_counter() - started
        with self.lock:
            if result is not None:
                self.optimizer.step(result.tensors)
            self.pending, self.boundary = keep, boundary
        if result is None:
            return RoundOutcome(applied_round=None)
        if result.group_size == 1 and result.note:
            logger.warning("round %d averaged alone: %s", pending.round, result.note)
        return RoundOutcome(
            applied_round=pending.round,
            group_size=result.group_size,
            seconds_wait=waited,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            coverage=result.coverage,
            peers=result.peers,
            allreduce_window=result.window,
            fallback=result.fallback,
        )

    def hash(self) -> str:
        return state_hash(self.theta_g)

    def state_dict(self) -> dict:
        """theta_g, momentum and the pending average if it is already known."""
        pending, missing = None, None
        if self.pending is not None and self.pending.future.done():
            result = self.pending.future.result()
            pending = {"round": self.pending.round, "tensors": result.tensors, "group_size": result.group_size}
        elif self.pending is not None:
            missing = self.pending.round  # still in flight: a resumed worker must get it from its stage group
        return {
            "boundary": self.boundary,
            "theta_g": self.theta_g,
            "momentum": self.optimizer.buffers,
            "pending": pending,
            "pending_missing": missing,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            for dst, src in zip(self.theta_g, state["theta_g"]):
                dst.copy_(src)
            for dst, src in zip(self.optimizer.buffers, state["momentum"]):
                dst.copy_(src)
            self.pending = None
            self.boundary = state["boundary"]
            self.missing_pending = state.get("pending_missing")
            if state.get("pending") is not None:
                p = state["pending"]
                future: Future[AveragingResult] = Future()
                future.set_result(AveragingResult(tensors=list(p["tensors"]), group_size=p["group_size"]))
                self.pending = _Pending(p["round"], future)

    def pending_future(self) -> Future[AveragingResult] | None:
        return self.pending.future if self.pending is not None else None

    def snapshot(self) -> tuple[int, list[torch.Tensor], int | None, int] | None:
        """A consistent copy of what a joiner needs to continue exactly as this worker will.

        Returns (boundary, theta_g + momentum [+ the pending average], pending round or
        None, pending group size), or None while the pending average is still in flight
        (or was lost with a checkpoint) and the state is therefore incomplete.
        """
        with self.lock:
            if self.missing_pending is not None or (self.pending is not None and not self.pending.future.done()):
                return None
            tensors = [t.clone() for t in (*self.theta_g, *self.optimizer.buffers)]
            if self.pending is None:
                return self.boundary, tensors, None, 0
            result = self.pending.future.result()
            return self.boundary, tensors + [t.clone() for t in result.tensors], self.pending.round, result.group_size
