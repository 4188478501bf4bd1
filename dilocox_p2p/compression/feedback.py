"""Error feedback: what compression left out of a round is sent in later rounds.

    e <- decay * e + delta          (the buffer absorbs this round's pseudo-gradient)
    message <- compress(e)
    e <- e - decompress(message)     (once an average counted the message: codec.RoundCodec.settle)

With decay 1 the averaged messages add up to the true pseudo-gradients minus the buffer, so
nothing is lost for good, only delayed (`test_compression.py` shows the residual stays
bounded); a message no average counted (never received, refused, its round stranded) stays in
the buffer whole. SparseLoCo uses decay ~0.95 and drops the outer momentum: the buffer is the
momentum. The buffer is this peer's own (per stage): kept in its checkpoints, never part of
the shared, hashed state; a late joiner starts with an empty one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ErrorFeedback"]

FP32_MAX = float(torch.finfo(torch.float32).max)


class ErrorFeedback:
    """One buffer per tensor of a stage."""

    def __init__(self, like: Sequence[torch.Tensor], *, decay: float = 1.0):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.buffers = [torch.zeros(t.shape, dtype=torch.float32) for t in like]

    @torch.no_grad()
    def absorb(self, delta: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """e <- decay * e + delta; returns the buffers (what is to be compressed). `delta` must be finite
        (codec.StageCodec.begin keeps any other out); a sum beyond fp32's range is held at its largest
        value, never Inf: a buffer never holds a non-finite value."""
        for e, d in zip(self.buffers, delta):
            if self.decay != 1.0:
                e.mul_(self.decay)
            e.add_(d).clamp_(-FP32_MAX, FP32_MAX)
        return self.buffers

    @torch.no_grad()
    def sent(self, decoded: Sequence[torch.Tensor]) -> None:
        """e <- e - what the message carried."""
        for e, d in zip(self.buffers, decoded):
            e.sub_(d)

    def reset(self) -> None:
        for e in self.buffers:
            e.zero_()

    def state_dict(self) -> dict[str, object]:
        return {"decay": self.decay, "buffers": [e.clone() for e in self.buffers]}

    def load_state_dict(self, saved: dict[str, object]) -> None:
        buffers = list(saved["buffers"])  # type: ignore[arg-type]
        if len(buffers) != len(self.buffers) or any(a.shape != b.shape for a, b in zip(buffers, self.buffers)):
            raise ValueError("the error-feedback buffers in the checkpoint do not fit this stage")
        for e, saved_e in zip(self.buffers, buffers):
            e.copy_(saved_e)
