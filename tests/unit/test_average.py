"""Averages with missing spans: splitting, intersecting, mending, and what the outer step does with them.

    pytest tests/unit/test_average.py -q
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocox_p2p.average import (
    Average,
    AverageKind,
    average_hash,
    covered_share,
    fill_missing,
    intersect_spans,
    bound,
    malformed_average,
    screen,
    spans_by_tensor,
)
from dilocox_p2p.config import OuterConfig
from dilocox_p2p.outer import OuterLoop, OuterNesterov
from tests.helpers.recording_averager import RecordingAverager

pytestmark = pytest.mark.unit


@st.composite
def spans(draw, total: int):
    cuts = sorted(draw(st.sets(st.integers(0, total), max_size=8)))
    return tuple((a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b)


def _covered(span_list, total):
    mask = [False] * total
    for a, b in span_list:
        for i in range(a, b):
            mask[i] = True
    return mask


def test_spans_are_split_over_the_tensors_they_cross():
    assert list(spans_by_tensor(((2, 7), (9, 10)), [4, 3, 5])) == [(0, 2, 4), (1, 0, 3), (2, 2, 3)]


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_intersection_holds_exactly_the_coordinates_missing_from_both(data):
    total = 40
    a, b = data.draw(spans(total)), data.draw(spans(total))
    got = _covered(intersect_spans(a, b), total)
    assert got == [x and y for x, y in zip(_covered(a, total), _covered(b, total))]


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_filling_takes_the_other_copys_values_where_only_this_one_misses_them(data):
    sizes = [5, 7, 3]
    total = sum(sizes)
    truth = [torch.arange(float(n)) + 100 * i for i, n in enumerate(sizes)]
    mine_missing, other_missing = data.draw(spans(total)), data.draw(spans(total))

    def copy_with_zeros(missing):
        out = [t.clone() for t in truth]
        for i, a, b in spans_by_tensor(missing, sizes):
            out[i][a:b] = 0
        return out

    mine, other = copy_with_zeros(mine_missing), copy_with_zeros(other_missing)
    filled, still = fill_missing(mine, mine_missing, other, other_missing)
    assert still == intersect_spans(mine_missing, other_missing)
    expected = copy_with_zeros(still)
    assert all(torch.equal(f, e) for f, e in zip(filled, expected))
    assert all(torch.equal(m, c) for m, c in zip(mine, copy_with_zeros(mine_missing))), "the input was modified"
    # the merge is symmetric: both members end with the same bytes
    theirs, theirs_still = fill_missing(other, other_missing, mine, mine_missing)
    assert theirs_still == still and average_hash(theirs, theirs_still) == average_hash(filled, still)


def test_coverage_is_the_share_of_coordinates_not_missing():
    assert covered_share(((0, 25),), 100) == 0.75
    average = Average(kind=AverageKind.PARTIAL, tensors=[torch.zeros(10), torch.zeros(10)], missing=((5, 10),))
    assert average.coverage == 0.75
    assert Average(kind=AverageKind.STRANDED, tensors=[]).coverage == 0.0


def test_the_outer_step_leaves_missing_coordinates_and_their_momentum_exactly_as_they_were():
    gen = torch.Generator().manual_seed(0)
    theta = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    reference = [t.clone() for t in theta]
    opt, ref = OuterNesterov(theta, lr=0.7, momentum=0.9), OuterNesterov(reference, lr=0.7, momentum=0.9)
    missing = ((2, 6), (13, 15))
    for _ in range(3):
        delta = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
        before = ([t.clone() for t in theta], [b.clone() for b in opt.buffers])
        opt.step(delta, missing=missing)
        ref.step(delta)
        for i, a, b in spans_by_tensor(missing, [12, 5]):
            assert torch.equal(theta[i].view(-1)[a:b], before[0][i].view(-1)[a:b])
            assert torch.equal(opt.buffers[i].view(-1)[a:b], before[1][i].view(-1)[a:b])
    kept = torch.ones(17, dtype=torch.bool)
    kept[2:6] = kept[13:15] = False
    flat = torch.cat([t.view(-1) for t in theta])
    assert not torch.equal(flat[~kept], torch.cat([t.view(-1) for t in reference])[~kept])
    assert torch.equal(flat[kept], torch.cat([t.view(-1) for t in reference])[kept])


def _loop(averager, mode="sync"):
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    loop = OuterLoop(params, OuterConfig(mode=mode, lr=0.5, momentum=0.9), averager)
    loop.load_into_model()
    with torch.no_grad():
        for p in params:
            p.sub_(0.25)
    return loop


def test_a_partial_average_moves_only_the_coordinates_it_covers():
    loop = _loop(RecordingAverager(missing=((1, 4),)))
    outcome = loop.end_round(0)
    assert outcome.kind is AverageKind.PARTIAL and outcome.coverage == pytest.approx(4 / 7)
    flat = torch.cat([t.view(-1) for t in loop.theta_g]).tolist()
    assert flat[1:4] == [1.0, 1.0, 1.0]
    assert all(v != 1.0 for i, v in enumerate(flat) if not 1 <= i < 4)


class _Stranded(RecordingAverager):
    def resolve(self, round):
        self.futures[round].set_result(Average(kind=AverageKind.STRANDED, tensors=[], note="no group"))


def test_a_stranded_round_applies_nothing():
    loop = _loop(_Stranded())
    before = loop.hash()
    outcome = loop.end_round(0)
    assert outcome.kind is AverageKind.STRANDED and outcome.applied_round == 0
    assert loop.hash() == before


def test_a_pending_average_that_applies_nothing_is_not_part_of_the_served_state():
    loop = _loop(_Stranded(resolve="at_launch"), mode="delayed")
    loop.end_round(0)
    known, pending = loop.known_pending()
    assert known and pending is None
    state = loop.state()
    assert state is not None and state.pending is None and state.boundary == 1


def test_a_lone_peer_never_applies_a_non_finite_pseudo_gradient():
    from dilocox_p2p.average import LocalAverager

    bad = LocalAverager().all_reduce([torch.tensor([1.0, float("inf")])], round=3).result()
    assert bad.kind is AverageKind.STRANDED and not bad.kind.applies
    good = LocalAverager().all_reduce([torch.tensor([1.0, 2.0])], round=3).result()
    assert good.kind is AverageKind.ALONE and torch.equal(good.tensors[0], torch.tensor([1.0, 2.0]))


# ----- an average's fields as another worker names them ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "spans", "total", "why"),
    [
        ("bogus", [], None, "kind 'bogus' is not one of averaged, partial"),
        ("partial", [(5, 5)], None, "not sorted, disjoint and non-empty"),
        ("partial", [(7, 3)], None, "not sorted, disjoint and non-empty"),
        ("partial", [(-4, 3)], None, "not sorted, disjoint and non-empty"),
        ("partial", [(0, 4), (3, 8)], None, "not sorted, disjoint and non-empty"),
        ("partial", [(0, 4), (6, 11)], 10, "within [0, 10)"),
    ],
)  # fmt: skip
def test_a_malformed_kind_or_span_says_what_is_wrong(kind, spans, total, why):
    assert why in malformed_average(kind, spans, total)


def test_every_kind_this_software_writes_with_sorted_disjoint_spans_is_well_formed():
    for kind in AverageKind:
        assert malformed_average(kind.value, [(0, 4), (4, 8), (9, 10)], 10) is None


# ----- the norm screen ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("norms", "refused"), [
    ({0: 1.0, 1: 1.2, 2: 50.0}, [2]),  # outsized
    ({0: 1.0, 1: float("nan"), 2: 1.1}, [1]),  # not finite
    ({0: 0.0, 1: 0.0, 2: 1e30}, [2]),  # a zero median: nothing was refused (issue 38, point 1)
    ({0: 0.0, 1: 0.0, 2: 0.0}, []),  # nothing sent by anyone: nothing to refuse
    ({0: 1.0, 1: 9.0}, []),  # two members: the smaller is the bar, 9x passes
])  # fmt: skip
def test_the_screen_leaves_out_what_is_not_finite_or_far_above_the_groups_lower_median(norms, refused):
    assert sorted(screen(norms, 10.0)) == refused


def test_the_clip_scales_what_is_above_its_bar_down_to_it_and_nothing_else():
    refused, scales = bound({0: 1.0, 1: 1.2, 2: 9.0, 3: 50.0}, 10.0, 1.5)  # lower median 1.2: bar 1.8
    assert refused.keys() == {3} and scales == pytest.approx({2: 1.8 / 9.0})
    assert bound({0: 1.0, 1: 1.2, 2: 9.0}, 10.0, 0.0) == ({}, {})  # off
    assert bound({0: 0.0, 1: 0.0, 2: 0.0}, 10.0, 1.5) == ({}, {})  # nothing sent: nothing to scale

