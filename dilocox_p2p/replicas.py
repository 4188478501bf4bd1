"""Data parallelism inside a peer (run.replicas, DP x PP): replica 0 leads, the other replicas follow.

A peer of R replicas runs R copies of its pipeline (peer_layout.py). Replica 0 is the peer as it is with
one replica: its stages are the swarm's members (one per stage), hold theta_g and the outer state, and write
the checkpoints, metrics.jsonl and the control plane. A stage's copies in replicas 1..R-1 (followers) hold
none of that. Every inner step each replica trains its 1/R of the step's batch through its own pipeline, and
the copies average their gradients before the clip and AdamW (inner.py), so all copies keep the same weights
and AdamW state; the step is the whole batch's, as one replica training all of it.

Whatever changes a stage's weights outside its inner steps happens on replica 0 alone (the outer step and
theta_g loaded at a boundary, a state taken from the swarm or a checkpoint, a streaming merge mid-round).
So at the start of every round replica 0's copy of each stage sends its copies the round to train (its first
step and step count), its data sampler's position, its weights and its AdamW state (`RoundStart`), and after
a streaming merge its weights again; a follower trains exactly the rounds it is sent and leaves at `send_end`.
The copies' weights are then replica 0's bit for bit at every round start, whatever happened before.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import Config
from .data import BatchSampler, load_corpus
from .inner import InnerTrainer
from .peer_layout import PeerGroups

__all__ = ["ReplicaSync", "RoundStart", "follow", "share_of"]

logger = logging.getLogger(__name__)

BUCKET_BYTES = 64 * 2**20  # tensors travel in flat buffers of at most this (one collective each)


def share_of(batch_size: int, replicas: int, replica: int) -> slice:
    """The rows of every batch that `replica` trains (all of them for a peer of one replica)."""
    rows = batch_size // replicas
    return slice(replica * rows, (replica + 1) * rows)


@dataclass(frozen=True)
class RoundStart:
    """What a round's followers train: `steps` inner steps from global step `first_step`, the weights sent again
    after step `merge_after` (streaming; 0: never), batches drawn from the sampler state `sampler`."""

    first_step: int
    steps: int
    merge_after: int
    sampler: torch.Tensor | None
    moments: list[float] | None  # AdamW's step count of each parameter (None: no step taken yet)


class ReplicaSync:
    """One stage's link to its copies in the other replicas: replica 0 sends, the others receive."""

    def __init__(self, trainer: InnerTrainer, groups: PeerGroups, stage: int):
        if groups.copies is None:
            raise ValueError("a peer of one replica has no copies to keep in step")
        self.trainer, self.groups = trainer, groups
        self.source = stage  # replica 0's copy of this stage: global rank = stage
        self.sending = groups.replica == 0
        self._ended = False
        self._in_round = False  # replica 0 sent a round whose steps its copies may still be in

    # ----- replica 0 ------------------------------------------------------------------------
    def send_round(self, first_step: int, steps: int, merge_after: int, sampler: BatchSampler | None) -> None:
        opt = self.trainer.optimizer
        moments = opt.steps_taken()
        start = RoundStart(first_step, steps, merge_after, sampler.state() if sampler else None, moments)
        dist.broadcast_object_list([start], src=self.source, group=self.groups.copies_control)
        self._tensors(with_moments=moments is not None)
        self._in_round = True

    def end_round(self) -> None:
        """Replica 0's steps of the round ended (done, or stopped at a step: its copies stopped at the same one)."""
        self._in_round = False

    def send_weights(self) -> None:
        self._broadcast(self.trainer.params)

    def send_end(self) -> None:
        """No more rounds: the followers leave (once, on every way out of replica 0's stage worker). Not from the
        middle of a round (an error in a step): the copies wait in a step's collective, not for this; the launcher
        stops them as it stops every stage of a peer one of whose stages failed."""
        if self._ended or self._in_round:
            return
        self._ended = True
        dist.broadcast_object_list([None], src=self.source, group=self.groups.copies_control)

    # ----- replicas 1.. -----------------------------------------------------------------------
    def receive_round(self, sampler: BatchSampler | None) -> RoundStart | None:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.source, group=self.groups.copies_control)
        start: RoundStart | None = box[0]
        if start is None:
            return None
        if sampler is not None and start.sampler is not None:
            sampler.load_state(start.sampler)
        if start.moments is not None:
            self.trainer.optimizer.set_steps_taken(start.moments)
        self._tensors(with_moments=start.moments is not None)
        return start

    def receive_weights(self) -> None:
        self._broadcast(self.trainer.params)

    # ----- both -----------------------------------------------------------------------------------
    def _tensors(self, *, with_moments: bool) -> None:
        tensors = list(self.trainer.params)
        if with_moments:
            tensors += self.trainer.optimizer.moments()
        self._broadcast(tensors)

    @torch.no_grad()
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Replica 0's `tensors` into its copies' (same shapes, dtypes and devices on both sides), bucket by bucket."""
        for bucket in _buckets(tensors):
            if self.sending:
                flat = torch.cat([t.reshape(-1) for t in bucket])
            else:
                flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            dist.broadcast(flat, src=self.source, group=self.groups.copies)
            if not self.sending:
                offset = 0
                for t in bucket:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, at most BUCKET_BYTES each (a larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        last = buckets[-1] if buckets else None
        fits = last is not None and (t.dtype, t.device) == (last[0].dtype, last[0].device)
        if not fits or size + t.numel() * t.element_size() > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel() * t.element_size()
    return buckets


def follow(cfg: Config, *, stage: int, groups: PeerGroups, device: torch.device, data_seed: int) -> int:
    """The life of a follower (a stage's copy in replica 1..R-1): train the rounds replica 0 sends until it ends
    them; return the exit code (128 + the signal where a stop signal ended the peer)."""
    stopped: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stopped.append(signum))  # replica 0 ends the rounds
    trainer = InnerTrainer(cfg, stage=stage, device=device, group=groups.pipeline, replicas=groups.replicas,
                           replica_group=groups.copies)  # fmt: skip
    sampler = None
    if trainer.is_first or trainer.is_last:
        corpus = load_corpus(cfg.data, cfg.model.shape.seq_len)
        sampler = BatchSampler(corpus.train, cfg.model.shape.seq_len, cfg.inner.batch_size, data_seed)
    share = share_of(cfg.inner.batch_size, groups.replicas, groups.replica)
    sync = ReplicaSync(trainer, groups, stage)
    logger.info("replica %d of %d: follows replica 0's stage %d", groups.replica, groups.replicas, stage)
    while (start := sync.receive_round(sampler)) is not None:
        for i in range(start.steps):
            inputs, targets = sampler.next() if sampler else (None, None)
            if inputs is not None:
                inputs, targets = inputs[share], targets[share]
            result = trainer.train_step(start.first_step + i, inputs, targets, stop=bool(stopped))
            if result.stop:
                break  # every stage of every replica saw it: replica 0 ends the rounds
            if i + 1 == start.merge_after:
                sync.receive_weights()
    return 128 + stopped[0] if stopped else 0
