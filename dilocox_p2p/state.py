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
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .average import Average, average_hash

__all__ = ["PendingAverage", "StageState", "state_hash"]


def state_hash(tensors: Sequence[torch.Tensor]) -> str:
    """Hex SHA-256 of the tensors' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


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

