"""What leaves a worker's error-feedback buffer once a round's average is known (a mixin of codec.RoundCodec).

A message gives up its values only where the average this worker applies counted it: whole (`settle`: the
all-gather, or an average borrowed from a group that counted it), or span by span (`settle_spans`,
`settle_factor_spans`: the compressed butterfly, compression/butterfly.py, where each reducer averaged this
worker's part of its span or left it out). What leaves is what every member decoded of it; the rest stays
whole in the buffer, to be sent again. A reducer's own rounding of its span's mean goes in through
`subtract_factors` (low-rank) or the layout's `subtract` (butterfly.reduce). Nothing after a reset: the
round was begun with a buffer this peer has since dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .payload import FlatLayout, rows_per_slice, slice_step

if TYPE_CHECKING:
    from .codec import Decoded, StageCodec

__all__ = ["Settlement"]


class Settlement:
    """The error-feedback side of codec.RoundCodec."""

    codec: StageCodec
    round: int
    from_buffer: bool
    generation: int
    settled: bool
    settled_factors: bool
    sent: bytes | None
    sent_factors: list[tuple[torch.Tensor, torch.Tensor]]
    phase1: Decoded | None
    shares: dict[int, float]
    """Phase -> the share of this worker's message of that phase that the applied average counted."""

    @property
    def counted_share(self) -> float | None:
        """The share of this worker's message that the average it applies counted (low-rank: the mean of its two
        phases'), as settled; None before it settled."""
        return sum(self.shares.values()) / len(self.shares) if self.shares else None

    def settle(self, counted: bool, *, factors: bool | None = None) -> None:
        """Once per round: if the average this worker applies `counted` its message, what the message carried
        leaves the error-feedback buffer (as decoded: the same bits as every member decoded); otherwise the
        buffer keeps it whole, to be sent again. `factors`: whether the low-rank factors (phase 2) were
        counted, where that differs. Nothing after a reset (this peer moved on: a new buffer)."""
        codec = self.codec
        with codec.lock:
            if self.settled or self.generation != codec.generation:
                return
            self.settled = True
            self.shares[1] = float(counted)
            if codec.phases == 2:
                self.shares[2] = float(counted if factors is None else factors)
            if not self.from_buffer:  # no error feedback, or a delta that never entered the buffer
                return
            if counted:
                self._give_back(None)
            if not (counted if factors is None else factors):
                return
            for i, (b, qt) in zip(codec.factored, self.sent_factors):  # this peer's part B B^T M_i of the average
                buffer, rows = codec.feedback.buffers[i], rows_per_slice(codec.feedback.buffers[i])
                for lo in range(0, buffer.shape[0], rows):
                    buffer[lo : lo + rows].sub_(b[lo : lo + rows] @ qt)

    def settle_decoded(self, decoded: Decoded, own: int | None) -> None:
        """`settle` on the all-gather's decoded mean (RoundCodec.mean) that this worker applies, `own` its index in
        the group (None: it sent nothing): low-rank's tensors sent whole count with phase 1, its factored matrices
        with phase 2."""
        if self.codec.phases == 1:
            self.settle(own is not None and own in decoded.used)
        else:
            assert self.phase1 is not None
            self.settle(own is not None and own in self.phase1.used, factors=own is not None and own in decoded.used)

    def settle_spans(self, spans: Sequence[tuple[int, int]], total: int) -> None:
        """`settle` per span of the message's vector of `total` values (the compressed butterfly,
        compression/butterfly.py: each reducer averaged this worker's part of its span or left it out): the values
        of the spans counted leave the error-feedback buffer, the rest stays whole, to be sent again."""
        with self.codec.lock:
            if self.settled or self.generation != self.codec.generation:
                return
            self.settled = True
            self.shares[1] = _share(spans, total)
            if self.from_buffer:
                self._give_back(spans)

    def settle_factor_spans(self, spans: Sequence[tuple[int, int]], total: int) -> None:
        """`settle_spans` for low-rank's phase-2 message (its factors Q^T, in `pieces(2, ranks)`'s layout, `total`
        values): on the spans counted, this worker's part B B^T M_i of the average leaves the buffer."""
        codec = self.codec
        with codec.lock:
            if self.settled_factors or self.generation != codec.generation:
                return
            self.settled_factors = True
            self.shares[2] = _share(spans, total)
            if not self.from_buffer or not self.sent_factors:
                return
            layout = FlatLayout([qt.shape for _, qt in self.sent_factors], codec.pad)
            for lo, hi in spans:
                self.subtract_factors(layout, lo, hi, layout.read([qt for _, qt in self.sent_factors], lo, hi))

    def subtract_factors(self, layout: FlatLayout, lo: int, hi: int, values: torch.Tensor) -> None:
        """buffer_i -= B E_i, where E_i holds `values` at their place [lo, hi) of the phase-2 layout (one Q^T per
        factored matrix) and zeros elsewhere; B is this worker's own basis of the round (any rounding will do)."""
        codec = self.codec
        for j, a, b, at in layout.overlaps(lo, hi):
            basis_j = self.sent_factors[j][0]
            e = torch.zeros(layout.shapes[j].numel(), dtype=torch.float32)
            e[a:b] = values[at : at + b - a]
            codec.feedback.buffers[codec.factored[j]].sub_(basis_j @ e.view(layout.shapes[j]))

    def _give_back(self, spans: Sequence[tuple[int, int]] | None) -> None:
        """buffer -= what this worker's phase-1 message decodes to, on `spans` (None: all of it); never P's."""
        codec = self.codec
        if self.sent is None:
            return
        mine = codec.receive(self.sent, round=self.round, phase=1)
        buffers = [None if codec.lowrank[i] else b for i, b in enumerate(codec.feedback.buffers)]  # not P
        step = slice_step(codec.cfg, mine.layout.numel)
        for lo, hi in [(0, mine.layout.numel)] if spans is None else spans:
            for a in range(lo, hi, step):  # lo on a span unit: a slice starts on a block
                b = min(a + step, hi)
                mine.layout.subtract(buffers, a, b, mine.reader.read(a, b))


def _share(spans: Sequence[tuple[int, int]], total: int) -> float:
    """The share of `total` values that `spans` (disjoint) cover."""
    return sum(hi - lo for lo, hi in spans) / total if total else 1.0
