"""Streaming DiLoCo's fragments: every parameter in exactly one, and the sync schedule's formula.

    pytest tests/unit/test_fragments.py -q
"""

from __future__ import annotations

import pytest

from dilocox_p2p.config import PRESETS
from dilocox_p2p.errors import ConfigError
from dilocox_p2p.fragments import fragment_of, fragment_tensors
from dilocox_p2p.model import build_stage, stage_layout

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("preset,stages", [("tiny", 1), ("tiny", 2), ("small", 2), ("small", 3)])
def test_fragments_cover_every_parameter_of_every_stage_exactly_once_with_strided_layer_groups(preset, stages):
    shape = PRESETS[preset]
    for stage in range(stages):
        names = [n for n, _ in build_stage(shape, stages, stage, seed=0).named_parameters()]
        n_units = len(stage_layout(shape, stages)[stage])
        for count in range(1, n_units + 1):
            fragments = fragment_tensors(names, count, stage=stage)
            flat = sorted(i for f in fragments for i in f)
            assert flat == list(range(len(names))), "a parameter is in no fragment, or in two"
            assert all(fragments), "an empty fragment"
            for p, fragment in enumerate(fragments):  # fragment p: the stage's layer groups k with k mod P = p
                assert {int(names[i].split(".")[1]) % count for i in fragment} == {p}


def test_more_fragments_than_layer_groups_is_refused_with_the_limit():
    names = [n for n, _ in build_stage(PRESETS["tiny"], 2, 1, seed=0).named_parameters()]  # 2 blocks + head
    with pytest.raises(ConfigError, match="stage 1 holds only 3 layer groups; use at most 3 fragments"):
        fragment_tensors(names, 4, stage=1)


@pytest.mark.parametrize("count,steps", [(1, 10), (2, 10), (4, 20), (5, 100)])
def test_each_fragment_syncs_every_h_steps_offset_by_p_h_over_p(count, steps):
    total = 5 * steps
    every = steps // count
    # what the worker does: sync round s is `every` steps long and ends by syncing fragment_of(s, P)
    done = {p: [] for p in range(count)}
    for s in range(total // every):
        done[fragment_of(s, count)].append((s + 1) * every)
    for p in range(count):
        # the formula: fragment p syncs after every step t > 0 with t = p * H / P (mod H)
        want = [t for t in range(1, total + 1) if t % steps == p * steps // count]
        assert done[p] == want
        assert all(b - a == steps for a, b in zip(want, want[1:]))  # every H steps
    assert done[0][0] == steps and (count == 1 or done[1][0] == steps // count)
