"""The shared state of one stage at a round boundary: what every member of the stage group
holds bit-identically, what a joiner downloads, what checkpoints keep and what hashes cover.

    StageState(boundary b)
      theta_g     the global parameters theta_g(b)
      momentum    the outer Nesterov buffers at b
      pending     delayed mode: the average of round b-1, applied at the end of round b
      follows     a copy taken while that average was still in flight leaves it out: the
                  round whose average the taker gets apart (STATE_PENDING), else -1

`state_hash` covers theta_g and momentum (published at every boundary as `stage_hashes`);
`pending_hash` covers the pending average, published once it is known. A downloaded
state is accepted only when both match the hashes most of the stage group announced.

`state_hash` is the SHA-256 of the SHA-256 digests of the state's pieces (`piece_ranges`: up to
STATE_PIECES runs of whole tensors of about equal bytes), so that a joiner can take each piece from
another donor and check it on arrival: a donor's list of piece digests is checked against the hash
most of the group announced, and each piece against its digest in that list (swarm/state_service.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .average import Average, average_hash

__all__ = ["STATE_PIECES", "PendingAverage", "StageState", "digest_of_pieces", "piece_digests", "piece_ranges",
           "state_hash", "tensors_digest"]

STATE_PIECES = 8
"""Pieces a state is hashed and downloaded in (fewer where it has fewer tensors): a joiner takes them from up to
that many donors at once, and a piece is the unit a lying or slow donor costs."""


def piece_ranges(sizes: Sequence[int], pieces: int = STATE_PIECES) -> list[tuple[int, int]]:
    """The pieces of tensors of `sizes` bytes, in order: [start, end) runs of whole tensors, at most `pieces`, none
    empty. The k-th cut falls between the two tensors whose running totals come nearest k / pieces of all bytes,
    so that the pieces hold about equal bytes where no tensor is larger than a piece. Every peer cuts alike
    (integers only)."""
    total, cuts, running, k = sum(sizes), [], 0, 1
    for i, size in enumerate(sizes):
        before, running = running, running + size
        while k < pieces and running * pieces >= k * total:
            # before or after tensor i, whichever running total is nearer the k-th share
            cut = i if k * total - before * pieces < running * pieces - k * total else i + 1
            if cut > (cuts[-1] if cuts else 0):
                cuts.append(cut)
            k += 1
    starts = [0, *cuts]
    ends = [*cuts, len(sizes)]
    return [(a, b) for a, b in zip(starts, ends, strict=True) if a < b]


def tensors_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """SHA-256 of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.digest()


def piece_digests(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """The SHA-256 of each piece of `tensors` (`piece_ranges`)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    return [tensors_digest(tensors[a:b]) for a, b in piece_ranges(sizes)]


def digest_of_pieces(digests: Sequence[bytes]) -> str:
    """The state hash that a list of piece digests stands for."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def state_hash(tensors: Sequence[torch.Tensor]) -> str:
    """Hex SHA-256 of the SHA-256 digests of the tensors' pieces (`piece_ranges`), in order."""
    return digest_of_pieces(piece_digests(tensors))


@dataclass(frozen=True)
class PendingAverage:
    """An average known at a boundary but applied one round later (delayed mode)."""

    round: int
    average: Average


@dataclass(frozen=True)
class StageState:
    boundary: int
    theta_g: list[torch.Tensor]
    momentum: list[torch.Tensor]
    pending: PendingAverage | None = None
    follows: int = -1

    def hash(self) -> str:
        return state_hash([*self.theta_g, *self.momentum])

    def pending_hash(self) -> str:
        """Hash of the pending average ("" when there is none)."""
        if self.pending is None:
            return ""
        return average_hash(self.pending.average.tensors, self.pending.average.missing)

    def tensors(self) -> list[torch.Tensor]:
        """theta_g, momentum, then the pending average's tensors, in that order (the wire layout)."""
        pending = self.pending.average.tensors if self.pending is not None else []
        return [*self.theta_g, *self.momentum, *pending]

    def clone(self) -> StageState:
        pending = None
        if self.pending is not None:
            average = self.pending.average
            copied = dataclasses.replace(average, tensors=[t.clone() for t in average.tensors])
            pending = PendingAverage(self.pending.round, copied)
        return StageState(
            boundary=self.boundary,
            theta_g=[t.clone() for t in self.theta_g],
            momentum=[t.clone() for t in self.momentum],
            pending=pending,
            follows=self.follows,
        )

