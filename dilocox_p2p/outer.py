"""Outer loop of one stage worker: pseudo-gradient, Nesterov outer step, one-step delay, fragments.

DiLoCo: https://arxiv.org/abs/2311.08105   DiLoCoX: https://arxiv.org/abs/2506.21263

State (all on CPU, all for this stage only: the other half of the dual optimizer policy):
theta_g, the outer momentum, and in `delayed` mode the pending average of the last round
(state.py names this layout once: `StageState`).

    round t:  theta_local <- start_t; H inner steps            (start_t = theta_g, but see eager/own)
              delta_t = start_t - theta_local
              start all-reduce of delta_t                  -> Delta_t (a future)
              sync:    wait Delta_t,     theta_g <- nesterov(theta_g, Delta_t)
              delayed: wait Delta_{t-1}, theta_g <- nesterov(theta_g, Delta_{t-1})
              eager, own: theta_g moves as in delayed (true averages only, one round late), but
                       the next round starts from theta_g + this peer's own correction c_t:
                 own:   c_t = -delta_t          (keep this round's own progress: notes/outer-loop-variants.md)
                 eager: c_t = -lr (1 + mu) (delta_t - delta_{t-1}) / N   (Kale et al. 2025: the outer
                        step of the proxy Delta_{t-1} + (delta_t - delta_{t-1}) / N, which swaps this
                        peer's stale contribution for its fresh one, minus the step of Delta_{t-1})

              streaming (Streaming DiLoCo, arXiv 2501.18512): a round is a sync round of H/P inner steps
                       that averages one fragment f = fragment_of(t) (fragments.py) only:
                 delta_t = theta_g[f] - theta_local[f]      (against theta_g after the last commit)
                 at inner step tau of round t+1: wait Delta_t; theta_local[f] <- alpha theta_local[f]
                       + (1 - alpha) nesterov(theta_g, Delta_t)[f]   (merge; the other tensors train on)
                 at the end of round t+1: theta_g <- nesterov(theta_g, Delta_t) on f (commit, as delayed)
                 theta_local is never reset to theta_g (except after a new state: join, repair, resume)

The shared, hashed state is theta_g and momentum only: the correction (`OuterLoop.start`) and
streaming's trained weights are this peer's own, never served or hashed. Its checkpoints keep
them, so that a peer resumed from its own checkpoint goes on exactly as it would have; a peer
that takes the swarm's state (join, repair, catch-up) starts from theta_g without them.

Invariant: peers that applied the same averages hold bit-identical theta_g and momentum,
on any CPU; `StageState.hash` proves it. The all-reduce plugs in through `Averager`
(average.py): one call per round, returning a future of the average.

Determinism rule (every module that produces theta_g, momentum or a decoded average follows it):
1. Only IEEE-754 basic operations, each rounded on its own: `*`, `+`, `-`, `/` on float32
   tensors, or on float64 then one cast. Never `add_(x, alpha=a)`, `sub_(x, alpha=a)`,
   `addcmul_`, `addcdiv_`, `lerp_`, `torch.optim` steps or matmuls: torch's vectorized
   CPU kernels fuse the multiply and add (FMA) on AVX2/AVX-512 and not under
   `ATEN_CPU_CAPABILITY=default` or on other CPUs, so their bits depend on the machine.
   (`add_(x)` with the default alpha of 1 is exact either way.)
2. No reductions (`sum`, `mean`, `norm`) in shared state: their order follows the vector width.
   Sums over peers run in a fixed order (sender index), in float64, then one cast.
3. Where a sum must be exact (integer factors of a compressed message), use integer arithmetic.
4. Coordinates an average leaves out (`Average.missing`) are left exactly as they were,
   theta_g and momentum alike.
tests/unit/test_determinism.py runs the outer step and every decode under each
`ATEN_CPU_CAPABILITY` the machine supports and compares the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .average import Average, Averager, AverageKind, Spans, spans_by_tensor
from .config import OuterConfig
from .fragments import as_fragments, fragment_of, of_round
from .round_outcome import Applied, RoundOutcome
from .state import PendingAverage, StageState, state_hash

__all__ = ["OuterLoop", "OuterNesterov", "pseudo_gradient"]

logger = logging.getLogger(__name__)


def pseudo_gradient(theta_g: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """delta = theta_g - theta_local, on CPU in fp32."""
    return [g - p.detach().to("cpu", torch.float32) for g, p in zip(theta_g, params)]


class OuterNesterov:
    """Nesterov momentum on theta_g with the averaged pseudo-gradient as the gradient.

    The update of torch.optim.SGD(nesterov=True), written with separately rounded operations
    (the determinism rule above): m = mu*m + Delta; theta_g -= lr * (Delta + mu*m).
    """

    def __init__(self, theta_g: Sequence[torch.Tensor], *, lr: float, momentum: float):
        self.theta_g, self.lr, self.momentum = list(theta_g), lr, momentum
        self.buffers = [torch.zeros_like(t) for t in self.theta_g]

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor], *, missing: Spans = (), indices: Sequence[int] | None = None) -> None:
        """One outer step of the tensors `indices` (all by default: `delta` and `missing` are over those);
        coordinates in `missing` keep their theta_g and momentum."""
        chosen = range(len(self.theta_g)) if indices is None else indices
        self._step([self.theta_g[i] for i in chosen], [self.buffers[i] for i in chosen], delta, missing)

    @torch.no_grad()
    def preview(
        self, delta: Sequence[torch.Tensor], *, missing: Spans = (), indices: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """theta_g of the tensors `indices` as `step` would leave them, without changing anything."""
        chosen = range(len(self.theta_g)) if indices is None else indices
        thetas = [self.theta_g[i].clone() for i in chosen]
        self._step(thetas, [self.buffers[i].clone() for i in chosen], delta, missing)
        return thetas

    def _step(self, thetas: list[torch.Tensor], buffers: list[torch.Tensor], delta: Sequence[torch.Tensor], missing: Spans) -> None:
        kept = _copy_spans(thetas, buffers, missing)
        mu, lr = self.momentum, self.lr
        for theta, buf, d in zip(thetas, buffers, delta, strict=True):
            buf.mul_(mu).add_(d)
            theta.sub_(buf.mul(mu).add_(d).mul_(lr))
        for index, a, b, theta_part, buf_part in kept:
            thetas[index].view(-1)[a:b] = theta_part
            buffers[index].view(-1)[a:b] = buf_part


def _copy_spans(
    thetas: list[torch.Tensor], buffers: list[torch.Tensor], spans: Spans
) -> list[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
    numels = [t.numel() for t in thetas]
    return [
        (i, a, b, thetas[i].view(-1)[a:b].clone(), buffers[i].view(-1)[a:b].clone())
        for i, a, b in spans_by_tensor(spans, numels)
    ]


@dataclass
class _Pending:
    round: int
    future: Future[Average]
    # this worker's own pseudo-gradient of the round: a checkpoint taken while the average is in flight keeps it,
    # so that a worker resumed where nobody has that average any more applies it alone (`own_for_lost_pending`)
    own: list[torch.Tensor] | None = None
    # streaming: theta_g of the round's fragment after this average's step, computed off the training thread
    # as soon as the average arrives (None: not prepared; the merge computes it itself)
    preview: Future[list[torch.Tensor] | None] | None = None


class OuterLoop:
    """theta_g, the outer optimizer and the pending average for one stage."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        cfg: OuterConfig,
        averager: Averager,
        *,
        fragments: Sequence[Sequence[int]] | None = None,
    ):
        self.params = list(params)
        self.mode = cfg.mode
        self.start: list[torch.Tensor] | None = None  # eager/own: theta_g + this peer's correction (module docstring)
        self._last_delta: list[torch.Tensor] | None = None
        # streaming: the tensors of each fragment (fragments.py), tau, alpha, and whether the model holds this
        # peer's own trained weights (else the next round starts from theta_g)
        self.fragments = as_fragments(fragments, len(self.params))
        self.tau, self.alpha = cfg.overlap_steps, cfg.merge_alpha
        self._holds_local = False
        self._merged: int | None = None  # the round whose average was last merged into the model
        self._merge_wait = 0.0
        self.averager = averager
        self.theta_g = [p.detach().to("cpu", torch.float32, copy=True) for p in self.params]
        self.optimizer = OuterNesterov(self.theta_g, lr=cfg.effective_lr, momentum=cfg.effective_momentum)
        self.pending: _Pending | None = None
        self.boundary = 0  # rounds completed: theta_g is theta_g(boundary)
        self.pending_lost: int | None = None  # restored without the average that was in flight (round)
        self._lost_own: list[torch.Tensor] | None = None  # ... and with this worker's own pseudo-gradient of it
        self.lock = threading.RLock()  # held while the state changes, so a copy served to a peer is consistent
        self._previews: ThreadPoolExecutor | None = None  # streaming: prepares each merge (_prepare_merge)
        # called under the lock before the state moves on to the next boundary (not when the run's end drains the
        # last average into the state of the same boundary: that state was never announced, and kept for a joiner
        # it was served against records announcing the drained one)
        self.before_step: Callable[[], None] | None = None

    @torch.no_grad()
    def load_into_model(self) -> None:
        """theta_local <- the next round's start: theta_g, plus this peer's correction in eager/own mode;
        in streaming mode the trained weights go on (from theta_g after a new state, e.g. a join)."""
        if self.mode == "streaming":
            if self._holds_local:
                return
            self._holds_local = True
        for p, g in zip(self.params, self.start if self.start is not None else self.theta_g):
            p.copy_(g)

    @contextlib.contextmanager
    def theta_g_in_model(self) -> Iterator[None]:
        """Within: the model holds theta_g (to evaluate the shared model in every mode); then what it held."""
        if self.mode in ("sync", "delayed"):  # it holds theta_g already
            yield
            return
        with torch.no_grad():
            held = [p.detach().clone() for p in self.params]
            for p, g in zip(self.params, self.theta_g):
                p.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, h in zip(self.params, held):
                    p.copy_(h)

    def fragment_number(self, round: int) -> int:
        """The fragment sync round `round` averages (0 outside streaming mode)."""
        return fragment_of(round, len(self.fragments))

    def fragment_indices(self, round: int) -> list[int]:
        """The tensors whose pseudo-gradients sync round `round` averages."""
        return of_round(self.fragments, round)

    def end_round(self, round: int) -> RoundOutcome:
        """Compute delta_round, start its all-reduce, apply the average this mode applies now."""
        if self.mode == "streaming":
            return self._end_streaming(round)
        delta = pseudo_gradient(self.start if self.start is not None else self.theta_g, self.params)
        launched = _Pending(round, self.averager.all_reduce(delta, round=round), own=delta)
        if self.mode == "sync":
            return self._apply(launched, keep=None, boundary=round + 1)
        outcome = self._apply(self.pending, keep=launched, boundary=round + 1)
        if self.mode in ("eager", "own"):
            self._correct(delta, outcome)
        return outcome

    @torch.no_grad()
    def _correct(self, delta: list[torch.Tensor], outcome: RoundOutcome) -> None:
        """Set the next round's start: theta_g plus this peer's correction (module docstring)."""
        if self.mode == "own":
            correction = [-d for d in delta]
        else:
            average = outcome.last
            n = average.group_size if average is not None and average.kind.applies and average.group_size else 1
            scale = self.optimizer.lr * (1 + self.optimizer.momentum) / n
            last = self._last_delta or [torch.zeros_like(d) for d in delta]
            correction = [(prev - d) * scale for d, prev in zip(delta, last)]
        self._last_delta = delta
        with self.lock:
            self.start = [g + c for g, c in zip(self.theta_g, correction)]

    def _end_streaming(self, round: int) -> RoundOutcome:
        """Commit the last round's average to theta_g (merged into the model at step tau already), then
        compute this round's fragment's pseudo-gradient against theta_g and start its all-reduce."""
        self._merge_pending()  # a no-op unless the round had fewer than tau steps
        waited, self._merge_wait = self._merge_wait, 0.0
        indices = self.fragment_indices(round)

        def launch() -> _Pending:  # under the lock, after the step: a state served is never half-way
            delta = pseudo_gradient([self.theta_g[i] for i in indices], [self.params[i] for i in indices])
            return self._prepare_merge(_Pending(round, self.averager.all_reduce(delta, round=round), own=delta))

        outcome = self._apply(self.pending, keep=launch, boundary=round + 1)
        return RoundOutcome(outcome.applied, outcome.seconds_wait + waited)

    def after_inner_step(self, step: int) -> None:
        """Called after inner step `step` (1-based) of each round: streaming merges the pending average at tau."""
        if self.mode == "streaming" and step == self.tau:
            self._merge_pending()

    @torch.no_grad()
    def _merge_pending(self) -> None:
        """Streaming: wait for the pending average, then theta_local <- alpha theta_local + (1 - alpha) theta_g'
        on its fragment, theta_g' being theta_g after the outer step that commits it at the round's end."""
        pending = self.pending
        if pending is None or self._merged == pending.round:
            return
        started = time.perf_counter()
        average = pending.future.result()
        theta = pending.preview.result() if pending.preview is not None else self._preview(pending, average)
        self._merge_wait += time.perf_counter() - started
        self._merged = pending.round
        if theta is None:
            return
        for i, g in zip(self.fragment_indices(pending.round), theta):
            p = self.params[i]
            p.mul_(self.alpha).add_(g.to(p.device, p.dtype, non_blocking=True).mul_(1 - self.alpha))

    def _preview(self, pending: _Pending, average: Average) -> list[torch.Tensor] | None:
        """theta_g of `pending`'s fragment after its average's step (None when the average applies nothing)."""
        if not average.kind.applies:
            return None
        indices = self.fragment_indices(pending.round)
        with self.lock:
            theta = self.optimizer.preview(average.tensors, missing=average.missing, indices=indices)
        if any(p.is_cuda for p in self.params):  # pinned: the copy to the GPU at the merge does not wait
            theta = [t.pin_memory() for t in theta]
        return theta

    def _prepare_merge(self, pending: _Pending) -> _Pending:
        """Streaming: compute the merge's preview in a helper thread once the average arrives, so that the
        training thread (on a GPU, seconds of CPU work per merge at 350m) only copies and merges it. The state
        it reads (theta_g, momentum of the fragment) stays as it is until this pending is committed; a new
        state (join, repair) replaces the pending, and the new one is merged without a preview."""
        if self._previews is None:
            self._previews = ThreadPoolExecutor(max_workers=1, thread_name_prefix="merge-preview")
        preview: Future[list[torch.Tensor] | None] = Future()
        pending.preview = preview

        def compute() -> None:
            try:
                preview.set_result(self._preview(pending, pending.future.result()))
            except BaseException as e:  # the merge raises it in the training thread
                preview.set_exception(e)

        pending.future.add_done_callback(lambda _: self._previews.submit(compute))
        return pending

    def drain(self) -> RoundOutcome:
        """Apply the average still pending (delayed mode), e.g. at the end of the run."""
        return self._apply(self.pending, keep=None, boundary=self.boundary)

    def _apply(
        self, pending: _Pending | None, *, keep: _Pending | Callable[[], _Pending] | None, boundary: int
    ) -> RoundOutcome:
        """Wait for `pending` (outside the lock), then step theta_g, keep `keep` pending (a callable: what
        it returns, called under the lock after the step), move the boundary."""
        started = time.perf_counter()
        average = pending.future.result() if pending is not None else None
        waited = time.perf_counter() - started
        with self.lock:
            if self.before_step is not None and boundary != self.boundary:
                self.before_step()
            if average is not None and average.kind.applies:
                self.optimizer.step(average.tensors, missing=average.missing, indices=self.fragment_indices(pending.round))
            self.pending, self.boundary = keep() if callable(keep) else keep, boundary
        if pending is None or average is None:
            return RoundOutcome(seconds_wait=waited)
        if not average.kind.applies:
            logger.warning("round %d: nothing applied (%s): %s", pending.round, average.kind.value, average.note)
        return RoundOutcome(applied=(Applied(pending.round, average),), seconds_wait=waited)

    def hash(self) -> str:
        """Hash of the shared state held now: theta_g and momentum."""
        return state_hash([*self.theta_g, *self.optimizer.buffers])

    def fragment_hashes(self) -> list[str]:
        """Hash of each fragment's theta_g and momentum (streaming: a sync changes one of them)."""
        buffers = self.optimizer.buffers
        return [state_hash([*(self.theta_g[i] for i in f), *(buffers[i] for i in f)]) for f in self.fragments]

    def pending_future(self) -> Future[Average] | None:
        return self.pending.future if self.pending is not None else None

    # ----- the shared state ----------------------------------------------------------------
    def known_pending(self) -> tuple[bool, PendingAverage | None]:
        """(whether the pending average is known, it if it is and applies anything)."""
        with self.lock:
            if self.pending_lost is not None:
                return False, None
            if self.pending is None:
                return True, None
            if not self.pending.future.done():
                return False, None
            average = self.pending.future.result()
            return True, PendingAverage(self.pending.round, average) if average.kind.applies else None

    def state(self, *, now: bool = False) -> StageState | None:
        """A consistent copy of what a joiner needs to continue exactly as this worker will;
        None while the pending average is still in flight (or was lost with a checkpoint). `now`:
        theta_g and momentum even while that average is in flight, which the copy then names
        (`follows`) instead of holding it."""
        with self.lock:
            known, pending = self.known_pending()
            if known:
                return StageState(self.boundary, self.theta_g, self.optimizer.buffers, pending).clone()
            if not now or self.pending is None or self.pending_lost is not None:
                return None
            return StageState(self.boundary, self.theta_g, self.optimizer.buffers, follows=self.pending.round).clone()

    @torch.no_grad()
    def load_state(self, state: StageState, follows: Future[Average] | None = None) -> None:
        """Continue from `state`; `follows`: the average of round `state.follows` left out of it, as it
        arrives (the next boundary waits for it, as for an all-reduce of this worker's own)."""
        if (state.follows >= 0) != (follows is not None):
            raise ValueError(f"a state that leaves out round {state.follows}'s average needs it to follow, and only then")
        with self.lock:
            for dst, src in zip(self.theta_g, state.theta_g):
                dst.copy_(src)
            for dst, src in zip(self.optimizer.buffers, state.momentum):
                dst.copy_(src)
            self.boundary, self.pending, self.pending_lost, self._lost_own = state.boundary, None, None, None
            self.start = self._last_delta = None  # the swarm's state: no correction of this peer's yet
            self._holds_local, self._merged = False, None  # streaming: the next round starts from theta_g
            if state.pending is not None:
                future: Future[Average] = Future()
                future.set_result(state.pending.average)
                self.pending = _Pending(state.pending.round, future)
            elif follows is not None:
                self.pending = _Pending(state.follows, follows)

    def forget_lost_pending(self) -> tuple[int | None, bool]:
        """Nobody could serve the average lost with a checkpoint: apply this worker's own pseudo-gradient of that
        round in its place (as a round it averaged alone: what a lone peer would have applied) where the
        checkpoint kept it, else nothing. Returns (its round, whether the own one stands in)."""
        with self.lock:
            lost, own = self.pending_lost, self._lost_own
            self.pending_lost = self._lost_own = None
            if lost is not None and own is not None:
                future: Future[Average] = Future()
                future.set_result(Average(kind=AverageKind.ALONE, tensors=own))
                self.pending = _Pending(lost, future)
        return lost, own is not None

    # ----- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """theta_g, momentum and the pending average if it is already known."""
        with self.lock:
            state = self.state()
            lost, own = self.pending_lost, self._lost_own
            if state is None and lost is None and self.pending is not None:
                lost = self.pending.round  # still in flight: a resumed worker must get it from its stage group
                own = self.pending.own
            pending = None
            if state is not None and state.pending is not None:
                average = state.pending.average
                pending = {
                    "round": state.pending.round,
                    "kind": average.kind.value,
                    "tensors": average.tensors,
                    "missing": [list(s) for s in average.missing],
                    "group": list(average.group),
                }
            return {
                "boundary": self.boundary,
                "theta_g": self.theta_g,
                "momentum": self.optimizer.buffers,
                "pending": pending,
                "pending_lost": lost,
                "pending_own": own if lost is not None else None,
                "own": self._own_state(),
            }

    def _own_state(self) -> dict[str, Any]:
        """What this peer trains from beyond theta_g (eager/own: its correction; streaming: its trained
        weights), so that a resumed peer goes on exactly as it would have. Never served or hashed."""
        local = None
        if self.mode == "streaming" and self._holds_local:
            local = [p.detach().to("cpu", copy=True) for p in self.params]
        return {"start": self.start, "last_delta": self._last_delta, "local": local}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        pending = None
        if saved.get("pending") is not None:
            p = saved["pending"]
            average = Average(
                kind=AverageKind(p["kind"]),
                tensors=list(p["tensors"]),
                missing=tuple((int(a), int(b)) for a, b in p["missing"]),
                group=tuple(p["group"]),
            )
            pending = PendingAverage(p["round"], average)
        self.load_state(StageState(saved["boundary"], list(saved["theta_g"]), list(saved["momentum"]), pending))
        own = saved.get("own") or {}
        with self.lock, torch.no_grad():
            self.pending_lost = saved.get("pending_lost")
            own_pending = saved.get("pending_own")
            self._lost_own = list(own_pending) if own_pending is not None and self.pending_lost is not None else None
            if own.get("start") is not None and self.mode in ("eager", "own"):
                self.start, self._last_delta = list(own["start"]), own.get("last_delta")
            if own.get("local") is not None and self.mode == "streaming":
                for p, saved_p in zip(self.params, own["local"]):
                    p.copy_(saved_p)
                self._holds_local = True
