"""Model: presets' sizes, the stage partition, and stages that equal slices of the whole GPT.

Run: python -m pytest tests/unit/test_model.py -q
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dilocox_p2p.config import PRESETS
from dilocox_p2p.model import GPT, VOCAB, build_stage, lm_loss, partition_units, stage_layout, unit_param_counts

pytestmark = pytest.mark.unit


def _max_stage(counts, stages):
    return max(sum(counts[i] for i in r) for r in stages)


def _best_max_stage_by_brute_force(counts, n_stages):
    """Smallest possible largest stage over all cuts between blocks (embedding/head ride along)."""
    n_blocks = len(counts) - 2
    best = None
    for cuts in itertools.combinations(range(1, n_blocks), n_stages - 1):
        bounds = [0, *cuts, n_blocks]
        sizes = []
        for s in range(n_stages):
            lo = 0 if s == 0 else bounds[s] + 1
            hi = len(counts) if s == n_stages - 1 else bounds[s + 1] + 1
            sizes.append(sum(counts[lo:hi]))
        best = max(sizes) if best is None else min(best, max(sizes))
    return best


# ----- partition -------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small", "125m"])
@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_partition_is_contiguous_covers_all_units_and_gives_every_stage_a_block(preset, n_stages):
    counts = unit_param_counts(PRESETS[preset])
    stages = partition_units(counts, n_stages)
    assert len(stages) == n_stages
    assert stages[0].start == 0
    assert stages[-1].stop == len(counts)
    for before, after in zip(stages, stages[1:]):
        assert before.stop == after.start
    blocks = range(1, len(counts) - 1)
    for r in stages:
        assert any(i in blocks for i in r), f"stage {r} holds no transformer block"


@pytest.mark.parametrize("preset", ["tiny", "small", "125m"])
@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_partition_minimizes_the_largest_stage(preset, n_stages):
    counts = unit_param_counts(PRESETS[preset])
    stages = partition_units(counts, n_stages)
    largest = _max_stage(counts, stages)
    assert largest == _best_max_stage_by_brute_force(counts, n_stages)
    # and so it lies within one (block + embedding) of a perfectly even split
    ideal = sum(counts) / n_stages
    assert largest <= ideal + max(counts[0] + counts[1], counts[-2] + counts[-1])


def test_partition_of_equal_units_splits_them_evenly():
    counts = [0] + [10] * 8 + [0]
    stages = partition_units(counts, 4)
    assert [sum(counts[i] for i in r) for r in stages] == [20, 20, 20, 20]


@pytest.mark.parametrize("n_stages", [0, 5, 9])
def test_partition_rejects_more_stages_than_blocks_or_none(n_stages):
    counts = unit_param_counts(PRESETS["tiny"])  # 4 blocks
    with pytest.raises(ValueError, match=rf"cannot split 4 blocks into {n_stages} stages"):
        partition_units(counts, n_stages)


def test_stage_layout_is_the_partition_of_the_presets_unit_counts():
    shape = PRESETS["small"]
    assert stage_layout(shape, 2) == partition_units(unit_param_counts(shape), 2)


# ----- sizes -----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_unit_param_counts_match_the_built_units(preset):
    shape = PRESETS[preset]
    whole = build_stage(shape, 1, 0, seed=0)
    assert list(whole.units) == list(range(shape.n_layer + 2))
    built = [sum(p.numel() for p in layer.parameters()) for layer in whole.layers]
    assert built == unit_param_counts(shape)


def test_tiny_has_under_a_million_parameters():
    assert sum(unit_param_counts(PRESETS["tiny"])) < 1_000_000


def test_mini_has_between_one_and_two_million_parameters():  # the quality lab's second size (issue 40)
    assert 1e6 <= sum(unit_param_counts(PRESETS["mini"])) <= 2e6


def test_small_has_about_25_million_parameters():
    assert 20e6 <= sum(unit_param_counts(PRESETS["small"])) <= 30e6


@pytest.mark.parametrize(("preset", "nominal"), [("125m", 125e6), ("350m", 350e6), ("1b", 1e9)])
def test_large_presets_are_within_15_percent_of_their_names(preset, nominal):
    total = sum(unit_param_counts(PRESETS[preset]))
    assert 0.85 * nominal <= total <= 1.15 * nominal


# ----- stages equal the whole model ------------------------------------------------------


@pytest.mark.parametrize(("preset", "n_stages"), [("tiny", 1), ("tiny", 2), ("tiny", 3), ("tiny", 4), ("small", 2)])
def test_each_stage_is_bit_identical_to_the_same_units_of_the_whole_model(preset, n_stages):
    shape = PRESETS[preset]
    whole = GPT(shape, seed=7)
    covered = []
    for s in range(n_stages):
        stage = build_stage(shape, n_stages, s, seed=7)
        assert stage.units == stage_layout(shape, n_stages)[s]
        for index, layer in zip(stage.units, stage.layers):
            reference = dict(whole.stage.layers[index].named_parameters())
            mine = dict(layer.named_parameters())
            assert mine.keys() == reference.keys()
            for name, p in mine.items():
                assert torch.equal(p, reference[name]), f"unit {index} {name} differs"
            covered.append(index)
    assert covered == list(range(shape.n_layer + 2))


def test_different_seeds_give_different_weights():
    shape = PRESETS["tiny"]
    a, b = GPT(shape, seed=0), GPT(shape, seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.dim() >= 2:
            assert not torch.equal(pa, pb), f"{name} is the same for seeds 0 and 1"


def test_same_seed_gives_the_same_weights():
    shape = PRESETS["tiny"]
    a, b = GPT(shape, seed=3), GPT(shape, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_blocks_are_initialized_from_their_own_seed():
    layers = GPT(PRESETS["tiny"], seed=0).stage.layers
    assert not torch.equal(layers[1].qkv.weight, layers[2].qkv.weight)


def test_gpt_maps_byte_ids_to_next_byte_logits_and_starts_near_uniform_loss():
    shape = PRESETS["tiny"]
    model = GPT(shape, seed=0)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, shape.seq_len), generator=gen)
    logits = model(idx)
    assert logits.shape == (2, shape.seq_len, VOCAB)
    loss = lm_loss(logits, torch.randint(0, VOCAB, (2, shape.seq_len), generator=gen))
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.1


def test_model_is_causal():
    model = GPT(PRESETS["tiny"], seed=0)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (1, 32), generator=gen)
    changed = idx.clone()
    changed[0, 20] = (idx[0, 20] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[0, :20], b[0, :20])
    assert not torch.equal(a[0, 20:], b[0, 20:])
