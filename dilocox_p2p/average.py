"""What one round's exchange hands back to the outer loop, and the seam it comes through.

An `Average` says what the stage group's average of a round is *and how it was had*: its
`kind` is explicit (averaged, partial, mended, borrowed, alone, stranded, abandoned), so the
outer loop, the metrics and the operator all read the same fact instead of decoding a
combination of fields.

Coordinates a round could not average are `missing`: spans `[start, end)` over the
stage's tensors flattened and concatenated in order. The outer step leaves them exactly
as they were, theta_g and momentum alike, on every member (outer.py), and `fill_missing`
mends them from another member's average of the same group: a span that reached any member
came from one reducer, so every copy of it holds the same bits.

Determinism rule (see outer.py): everything here copies bits; nothing rounds, except
`ordered_mean`, which sums in a fixed order in float64 and casts once (rule 2).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = [
    "AGAINST",
    "Average",
    "AverageKind",
    "Averager",
    "LocalAverager",
    "Spans",
    "against_the_group",
    "alone",
    "applies_nothing",
    "average_hash",
    "bound",
    "covered_share",
    "fill_missing",
    "intersect_spans",
    "malformed_average",
    "norm",
    "ordered_mean",
    "screen",
    "spans_by_tensor",
]

logger = logging.getLogger(__name__)

Spans = tuple[tuple[int, int], ...]
"""Half-open coordinate ranges over a stage's tensors, flattened and concatenated in order."""


class AverageKind(str, enum.Enum):
    """How a round's average reached this worker."""

    AVERAGED = "averaged"
    """The group's all-reduce reached this worker whole."""
    PARTIAL = "partial"
    """Averaged, except spans whose reducer failed before any member got them: those stay unchanged."""
    MENDED = "mended"
    """Spans that missed this worker were taken from other members of its group, and it holds the whole
    average (a copy still missing spans that no member could give is PARTIAL, its `mended_from` kept)."""
    BORROWED = "borrowed"
    """This worker's own all-reduce failed; it took the average its group computed without it."""
    ALONE = "alone"
    """No other worker trains this stage: the average of a group of one (this worker's delta)."""
    STRANDED = "stranded"
    """Others train, but no average could be had: nothing is applied, theta_g stays as it was."""
    ABANDONED = "abandoned"
    """This peer moved on to the swarm's state; the round is dropped."""

    @property
    def applies(self) -> bool:
        """Whether the outer step uses this average at all."""
        return self not in (AverageKind.STRANDED, AverageKind.ABANDONED)


@dataclass(frozen=True)
class Average:
    """The average of one round's pseudo-gradients over a stage group, as this worker holds it."""

    kind: AverageKind
    tensors: list[torch.Tensor]
    missing: Spans = ()
    """Coordinates not averaged: the outer step leaves them (theta_g and momentum) exactly as they were."""
    group: tuple[str, ...] = ()
    """Peer ids of the group whose average this is (empty for a group of one)."""
    group_id: bytes = b""
    """The id hivemind's matchmaking gave that group (empty for a group of one)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    window: tuple[float, float] | None = None
    """Wall-clock (unix) start and end of the exchange, when there was one."""
    note: str = ""
    """Why the exchange went as it did, for the log."""
    mended_from: tuple[str, ...] = field(default=())
    """Members whose copies filled this worker's missing spans (MENDED, BORROWED)."""
    stranded_alike: bool = False
    """STRANDED: every member that answered had no average of the round either (nobody is ahead)."""
    off_majority: bool = False
    """This copy differs from the one most of its group holds, and theirs could not be had: the worker
    takes the swarm's state before it uses theta_g (a repair) instead of training on a split."""
    phases: tuple[tuple[str, float], ...] = ()
    """Seconds of each phase of the exchange, in order (swarm/phase_clock.py)."""
    phase_ends: tuple[tuple[str, float], ...] = ()
    """Unix time each phase of the exchange last ended, in the same order."""
    group_reused: bool = False
    """The group formed again without matchmaking: the last round's whole group (swarm/group_reuse.py)."""
    digests: tuple[bytes, ...] = ()
    """The compressed butterfly: the reducers' signed digests of the reduced parts this copy was assembled
    from, announced in phase 5, where two that one reducer signed for the same part prove it equivocated."""
    counted_by: tuple[tuple[str, ...] | None, ...] = ()
    """The compressed butterfly: per reducer, the peer ids of the members its reduced part averaged (None: not
    known to this copy, a span it misses or filled from a copy that did not say). A member settles its error
    feedback on the spans whose reducer counted it, whichever copy it applies (swarm/compressed_round.py)."""
    counted_share: float | None = None
    """Compressed rounds: the share of this worker's message that the average it applied counted, and so left
    its error-feedback buffer (the rest is sent again); None without compression."""

    @property
    def group_size(self) -> int:
        return max(len(self.group), 1)

    @property
    def coverage(self) -> float:
        """Share of the coordinates that were averaged."""
        if not self.kind.applies:
            return 0.0
        return covered_share(self.missing, sum(t.numel() for t in self.tensors))


class Averager(Protocol):
    """The seam between the outer loop and the network: one all-reduce per round."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, round: int) -> Future[Average]:
        """Start averaging `tensors` (this peer's pseudo-gradient of `round`) with the stage group.

        The tensors belong to the averager from now on. The future resolves to the average;
        it never raises for network trouble: what happened is the average's `kind`.
        """
        ...

    def close(self) -> None: ...


class LocalAverager:
    """The average over a group of one: this peer alone."""

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, round: int) -> Future[Average]:
        future: Future[Average] = Future()
        future.set_result(alone(tensors, round=round))
        return future

    def close(self) -> None:
        pass


def ordered_mean(parts: Iterable[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The mean of `parts` summed in the given order in float64, cast to float32 once. Parts may come
    from a generator: only the running sum and the part at hand are held."""
    total, count = None, 0
    for part in parts:
        total = part.to(torch.float64, copy=True) if total is None else total.add_(part)
        count += 1
    if total is None:
        return torch.zeros(shape)
    return total.div_(count).to(torch.float32)


def bound(norms: Mapping[int, float], max_ratio: float, clip_ratio: float = 0.0) -> tuple[dict[int, str], dict[int, float]]:
    """Robust aggregation with bounded influence: the contributions `screen` leaves out, and for each other one whose
    norm exceeds `clip_ratio` times the group's lower median, the scale that brings it down to that (0: none is
    scaled). An outlier below the screen's bar (a sign flip at 9x the median) then weighs at most `clip_ratio`
    honest contributions, not 9. The scale is applied as one rounded float32 multiply per value before the float64
    sum (payload.ScaledReader, allreduce.py): the same bits on any CPU."""
    refused, median = screen(norms, max_ratio), _lower_median(norms)
    if clip_ratio <= 0 or median is None:
        return refused, {}
    bar = clip_ratio * median
    return refused, {i: bar / n for i, n in norms.items() if i not in refused and n > bar > 0}


def _lower_median(norms: Mapping[int, float]) -> float | None:
    """The lower median of the finite norms (None: fewer than two): with two, the smaller one."""
    finite = sorted(n for n in norms.values() if math.isfinite(n))
    return finite[(len(finite) - 1) // 2] if len(finite) >= 2 else None


def screen(norms: Mapping[int, float], max_ratio: float) -> dict[int, str]:
    """Robust aggregation: the contributions to leave out of a mean, by index, with the reason. A
    contribution is left out if its norm is not finite, or if it exceeds `max_ratio` times the group's
    (lower) median norm: with two members the smaller one is the median, so one outsized sender
    cannot drag the bar up with it. Norms are float64 sums of squares' roots (any rounding will do:
    one reducer decides for every member)."""
    out = {i: "not finite (NaN or Inf)" for i, n in norms.items() if not math.isfinite(n)}
    median = _lower_median(norms)
    if median is None:
        return out
    for i, n in norms.items():
        if i in out or n <= max_ratio * median:
            continue
        if median <= 0:  # most sent nothing: any value at all is infinitely far above them ({0, 0, 1e30})
            out[i] = f"norm {n:.3g} where the group's median is 0"
        else:
            out[i] = f"norm {n:.3g} is {n / median:.0f}x the group's median {median:.3g} (limit {max_ratio:g}x)"
    return out


AGAINST = "points against the group's coordinate-wise median (left out, not struck)"
DIRECTION_STEP = 1 << 18  # values of each contribution read at once by the direction screen


def against_the_group(read: Mapping[int, Callable[[int, int], torch.Tensor]], numel: int) -> dict[int, str]:
    """Direction screen, beside `bound` (whose clip weighs a sign flip under the norm screen's bar as 1.5 honest
    contributions, still pulling the mean back): with three or more contributions, those whose dot product with
    the group's coordinate-wise (lower) median is negative are left out of the mean. One contribution of three or
    more cannot move that median far, so an honest one points with it. `read[i](lo, hi)` gives contribution i's
    values [lo, hi) of `numel`. Not struck (an honest one that is mostly noise can fall below now and then; with
    error feedback it is sent again); the same bits on any CPU: exact medians, float64 products summed in a fixed
    order (fixed_order_sum), slices of DIRECTION_STEP in order."""
    if len(read) < 3:
        return {}
    order = sorted(read)
    dots = dict.fromkeys(order, 0.0)
    for lo in range(0, numel, DIRECTION_STEP):
        hi = min(numel, lo + DIRECTION_STEP)
        rows = [read[i](lo, hi).reshape(-1).to(torch.float64) for i in order]
        median = lower_median(rows)
        for i, row in zip(order, rows):
            dots[i] += fixed_order_sum(row * median)
    return {i: AGAINST for i in order if dots[i] < 0}


MEDIAN_NETWORK_ROWS = 8
"""Up to this many rows, `lower_median` sorts them by elementwise min/max (n(n-1)/2 passes of two whole-row ops:
27x faster than torch.median over 3 rows); beyond, torch.median."""


def lower_median(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise lower median of equal-length rows (the ((n-1)//2)-th smallest of each coordinate):
    exact, the same bits on any CPU (every value is one of the rows')."""
    if len(rows) > MEDIAN_NETWORK_ROWS:
        return torch.stack(list(rows)).median(dim=0).values
    ordered = list(rows)
    for sweep in range(len(ordered)):  # odd-even transposition: n sweeps sort n rows
        for j in range(sweep % 2, len(ordered) - 1, 2):
            low, high = ordered[j], ordered[j + 1]
            ordered[j], ordered[j + 1] = torch.minimum(low, high), torch.maximum(low, high)
    return ordered[(len(ordered) - 1) // 2]


def fixed_order_sum(values: torch.Tensor) -> float:
    """The sum of `values` in float64 in one fixed pairwise order, by elementwise adds only: the same bits on any
    CPU, capability and thread count (torch.sum splits its work by the thread count, and its last bit follows).
    Each pass adds the second half onto the first (value i + value i + h, h the larger half; an odd count leaves
    its middle value unpaired): contiguous halves, one pass over memory each."""
    x = values.reshape(-1).to(torch.float64)
    n = x.numel()
    while n > 1:
        h = (n + 1) // 2
        y = torch.empty(h, dtype=torch.float64)
        torch.add(x[: n - h], x[h:n], out=y[: n - h])
        if n % 2:
            y[h - 1] = x[h - 1]
        x, n = y, h
    return float(x[0]) if n else 0.0


def norm(tensor: torch.Tensor) -> float:
    """The L2 norm in float64 (inf or nan for a tensor holding them)."""
    return float(torch.linalg.vector_norm(tensor.to(torch.float64)))


def applies_nothing(kind: AverageKind, note: str, started: float) -> Average:
    """An exchange that applies nothing (STRANDED, ABANDONED), begun at unix time `started` (0: now)."""
    return Average(kind=kind, tensors=[], note=note, window=(started or time.time(), time.time()))


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no tensor holds NaN or Inf: one pass for the smallest and largest value each (both NaN where a NaN
    is, and an Inf is one of them), ten times faster than `torch.isfinite(t).all()` on a CPU."""
    for t in tensors:
        if t.numel() and not all(math.isfinite(float(v)) for v in t.detach().aminmax()):
            return False
    return True


def alone(tensors: Sequence[torch.Tensor], *, round: int) -> Average:
    """The average of a group of one: the tensors themselves, unless they hold NaN or Inf (then
    nothing is applied, and the log says so)."""
    if all_finite(tensors):
        return Average(kind=AverageKind.ALONE, tensors=list(tensors))
    logger.error("round %d: the pseudo-gradient holds NaN or Inf: not applied (inner training may have "
                 "diverged: check the loss and inner.lr)", round)
    return Average(kind=AverageKind.STRANDED, tensors=[], note="a non-finite pseudo-gradient")


def covered_share(missing: Spans, total: int) -> float:
    if total == 0:
        return 1.0
    return 1.0 - sum(hi - lo for lo, hi in missing) / total


def malformed_average(kind: str, spans: Sequence[tuple[int, int]], total: int | None = None) -> str | None:
    """Why an average's kind and missing spans, as another worker's record or reply names them, cannot be used
    (None: they can): a kind no AverageKind names, or spans that are not sorted, disjoint and non-empty within
    [0, `total`) (None: no upper bound known). Checked where they arrive, so a malformed field is refused and
    never raises where it is used (intersect_spans and spans_by_tensor take them as every Spans is)."""
    if kind not in AverageKind._value2member_map_:
        return f"kind {kind[:30]!r} is not one of {', '.join(k.value for k in AverageKind)}"
    end = 0
    for lo, hi in spans:
        if not end <= lo < hi or (total is not None and hi > total):
            limit = "" if total is None else f" within [0, {total})"
            return f"missing span [{lo}, {hi}) is not sorted, disjoint and non-empty{limit}"
        end = hi
    return None


def spans_by_tensor(spans: Spans, numels: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(tensor index, start, end) within each tensor's flat view, for every piece of `spans`."""
    offset = 0
    for index, numel in enumerate(numels):
        for lo, hi in spans:
            a, b = max(lo - offset, 0), min(hi - offset, numel)
            if a < b:
                yield index, a, b
        offset += numel


def intersect_spans(a: Spans, b: Spans) -> Spans:
    """The coordinates missing from both (inputs sorted and disjoint, as every Spans is)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def fill_missing(
    tensors: Sequence[torch.Tensor], missing: Spans, other: Sequence[torch.Tensor], other_missing: Spans
) -> tuple[list[torch.Tensor], Spans]:
    """Copy into (copies of) `tensors` the coordinates they miss and `other` holds; return them and what
    is still missing. Both must be averages of the same group and round (the same reducers' bits)."""
    still = intersect_spans(missing, other_missing)
    if still == missing:
        return list(tensors), missing
    out = [t.clone() for t in tensors]
    numels = [t.numel() for t in out]
    fill = _subtract_spans(missing, still)
    for index, a, b in spans_by_tensor(fill, numels):
        out[index].view(-1)[a:b] = other[index].reshape(-1)[a:b]
    return out, still


def _subtract_spans(a: Spans, b: Spans) -> Spans:
    """Coordinates in `a` but not in `b` (b a subset of a, both sorted and disjoint)."""
    out: list[tuple[int, int]] = []
    for lo, hi in a:
        cursor = lo
        for blo, bhi in b:
            if bhi <= cursor or blo >= hi:
                continue
            if blo > cursor:
                out.append((cursor, blo))
            cursor = max(cursor, bhi)
        if cursor < hi:
            out.append((cursor, hi))
    return tuple(out)


def average_hash(tensors: Sequence[torch.Tensor], missing: Spans) -> str:
    """Hex SHA-256 of an average: its bytes and which coordinates it leaves unchanged."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    h.update(repr(tuple(missing)).encode())
    return h.hexdigest()
