"""Outer loop: Nesterov math, pseudo-gradients, and when each round's average is applied.

The order of launches and waits is checked with tests/helpers/recording_averager.py, an
in-memory Averager whose "average" of round r is a known multiple of round r's delta.

Run: python -m pytest tests/unit/test_outer.py -q
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import Future

import pytest
import torch

from dilocox_p2p.config import OuterConfig
from dilocox_p2p.average import AverageKind, LocalAverager
from dilocox_p2p.outer import OuterLoop, OuterNesterov, pseudo_gradient
from dilocox_p2p.state import state_hash
from tests.helpers.recording_averager import RecordingAverager

pytestmark = pytest.mark.unit

LR, MU = 0.7, 0.9


# ----- Nesterov --------------------------------------------------------------------------


def test_nesterov_matches_hand_computed_numbers():
    theta = torch.tensor([1.0], dtype=torch.float64)
    opt = OuterNesterov([theta], lr=0.7, momentum=0.9)
    # step 1: buf = 0.5; theta = 1.0 - 0.7 * (0.5 + 0.9 * 0.5) = 1.0 - 0.665 = 0.335
    opt.step([torch.tensor([0.5], dtype=torch.float64)])
    assert theta.item() == pytest.approx(0.335, abs=1e-12)
    assert opt.buffers[0].item() == pytest.approx(0.5, abs=1e-12)
    # step 2, delta -0.2: buf = 0.9 * 0.5 - 0.2 = 0.25
    #   theta = 0.335 - 0.7 * (-0.2 + 0.9 * 0.25) = 0.335 - 0.7 * 0.025 = 0.3175
    opt.step([torch.tensor([-0.2], dtype=torch.float64)])
    assert opt.buffers[0].item() == pytest.approx(0.25, abs=1e-12)
    assert theta.item() == pytest.approx(0.3175, abs=1e-12)
    # step 3, delta 0.5 again: buf = 0.9 * 0.25 + 0.5 = 0.725
    #   theta = 0.3175 - 0.7 * (0.5 + 0.9 * 0.725) = 0.3175 - 0.7 * 1.1525 = -0.48925
    opt.step([torch.tensor([0.5], dtype=torch.float64)])
    assert theta.item() == pytest.approx(-0.48925, abs=1e-12)


def test_nesterov_matches_torch_sgd_with_nesterov_momentum():
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 2, 2)]
    ours = [torch.randn(s, generator=gen) for s in shapes]
    theirs = [torch.nn.Parameter(t.clone()) for t in ours]
    opt = OuterNesterov(ours, lr=LR, momentum=MU)
    sgd = torch.optim.SGD(theirs, lr=LR, momentum=MU, nesterov=True)
    for _ in range(6):
        deltas = [torch.randn(s, generator=gen) for s in shapes]
        opt.step(deltas)
        for p, d in zip(theirs, deltas):
            p.grad = d.clone()
        sgd.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)


def test_nesterov_updates_theta_g_in_place():
    theta = torch.ones(3)
    opt = OuterNesterov([theta], lr=LR, momentum=MU)
    opt.step([torch.full((3,), 0.5)])
    assert opt.theta_g[0] is theta
    assert torch.allclose(theta, torch.full((3,), 0.335))


# ----- pseudo-gradient and hashes --------------------------------------------------------


def test_pseudo_gradient_is_theta_g_minus_the_local_params_in_fp32_on_cpu():
    theta_g = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    params = [torch.nn.Parameter(torch.tensor([0.25, 2.5])), torch.nn.Parameter(torch.tensor([[1.0]], dtype=torch.bfloat16))]
    delta = pseudo_gradient(theta_g, params)
    assert torch.equal(delta[0], torch.tensor([0.75, -0.5]))
    assert torch.equal(delta[1], torch.tensor([[2.0]]))
    assert all(d.dtype == torch.float32 and d.device.type == "cpu" and not d.requires_grad for d in delta)


def test_state_hash_is_equal_for_equal_tensors_and_differs_otherwise():
    a = [torch.arange(6.0).reshape(2, 3), torch.ones(4)]
    same = [t.clone() for t in a]
    changed = [a[0].clone(), torch.ones(4)]
    changed[1][2] = 1.0 + 2**-20
    assert state_hash(a) == state_hash(same)
    assert state_hash(a) != state_hash(changed)
    assert state_hash(a) != state_hash(list(reversed(a)))


def test_local_averager_returns_the_input_over_a_group_of_one():
    tensors = [torch.tensor([1.0, -2.0]), torch.zeros(3)]
    future = LocalAverager().all_reduce(tensors, round=4)
    assert future.done()
    result = future.result()
    assert result.kind is AverageKind.ALONE and result.group_size == 1 and result.coverage == 1.0
    assert len(result.tensors) == 2
    assert all(torch.equal(r, t) for r, t in zip(result.tensors, tensors))


# ----- rounds ----------------------------------------------------------------------------

# Per-round local deltas (what inner training moved each of the two tensors by).
DELTAS = [
    [[0.5, -0.25, 0.125], [[0.5, 0.0], [-1.0, 0.25]]],
    [[-0.2, 0.1, 0.3], [[0.05, -0.5], [0.75, 0.0]]],
    [[0.4, 0.4, -0.1], [[-0.3, 0.2], [0.1, 0.6]]],
    [[0.0, -0.6, 0.2], [[0.25, 0.25], [-0.5, -0.125]]],
]
THETA0 = [[1.0, 2.0, -1.0], [[0.5, -0.5], [1.5, 0.0]]]


def _flat(nested):
    if isinstance(nested, (list, tuple)):
        return [x for item in nested for x in _flat(item)]
    return [float(nested)]


class HandNesterov:
    """Element-wise Nesterov on Python floats (float64): the reference for OuterLoop."""

    def __init__(self, theta, lr, mu):
        self.theta, self.buf, self.lr, self.mu = list(theta), [0.0] * len(theta), lr, mu

    def step(self, delta):
        for i, d in enumerate(delta):
            self.buf[i] = self.mu * self.buf[i] + d
            self.theta[i] -= self.lr * (d + self.mu * self.buf[i])


def _make_loop(mode, averager, *, lr=LR):
    params = [torch.nn.Parameter(torch.tensor(t)) for t in THETA0]
    return OuterLoop(params, OuterConfig(mode=mode, lr=lr, momentum=MU), averager)


def _train_inner(loop, t):
    """Stand-in for H inner steps: theta_local <- theta_g, then move by -DELTAS[t]."""
    loop.load_into_model()
    with torch.no_grad():
        for p, d in zip(loop.params, DELTAS[t]):
            p.sub_(torch.tensor(d))


def _theta(loop):
    return [x for t in loop.theta_g for x in t.flatten().tolist()]


def test_sync_mode_applies_the_average_of_round_t_at_the_end_of_round_t():
    averager = RecordingAverager(scale=0.5, group_size=3)
    loop = _make_loop("sync", averager)
    hand = HandNesterov(_flat(THETA0), LR, MU)
    for t in range(len(DELTAS)):
        _train_inner(loop, t)
        outcome = loop.end_round(t)
        hand.step([0.5 * d for d in _flat(DELTAS[t])])
        assert outcome.applied_round == t
        assert outcome.group_size == 3
        assert _theta(loop) == pytest.approx(hand.theta, abs=1e-6)
    assert averager.events == [e for t in range(4) for e in (("launch", t), ("wait", t), ("resolve", t))]
    assert loop.drain().applied == ()


def test_each_round_launches_one_all_reduce_of_its_pseudo_gradient():
    averager = RecordingAverager()
    loop = _make_loop("delayed", averager)
    for t in range(3):
        _train_inner(loop, t)
        loop.end_round(t)
    assert [c.round for c in averager.calls] == [0, 1, 2]
    for call, deltas in zip(averager.calls, DELTAS):
        assert _flat([c.tolist() for c in call.tensors]) == pytest.approx(_flat(deltas), abs=1e-6)


def test_delayed_mode_applies_nothing_at_the_end_of_round_0():
    averager = RecordingAverager()
    loop = _make_loop("delayed", averager)
    before = [t.clone() for t in loop.theta_g]
    _train_inner(loop, 0)
    outcome = loop.end_round(0)
    assert outcome.applied_round is None
    assert all(torch.equal(a, b) for a, b in zip(loop.theta_g, before))
    assert averager.events == [("launch", 0)]


def test_delayed_mode_applies_round_t_minus_1_average_at_end_of_round_t_and_drain_applies_the_last():
    averager = RecordingAverager(scale=0.5)
    loop = _make_loop("delayed", averager)
    hand = HandNesterov(_flat(THETA0), LR, MU)
    for t in range(len(DELTAS)):
        _train_inner(loop, t)
        outcome = loop.end_round(t)
        if t == 0:
            assert outcome.applied_round is None
        else:
            hand.step([0.5 * d for d in _flat(DELTAS[t - 1])])
            assert outcome.applied_round == t - 1
        assert _theta(loop) == pytest.approx(hand.theta, abs=1e-6)
    last = loop.drain()
    hand.step([0.5 * d for d in _flat(DELTAS[-1])])
    assert last.applied_round == len(DELTAS) - 1
    assert _theta(loop) == pytest.approx(hand.theta, abs=1e-6)
    assert loop.drain().applied == ()


def test_the_state_is_offered_for_keeping_before_each_step_to_a_new_boundary_but_not_before_the_final_drain():
    # before_step keeps the complete state of the boundary being left for a waiting joiner (swarm/worker.py); the
    # drain at the run's end changes the state of the last boundary in place, before that boundary is announced
    loop = _make_loop("delayed", RecordingAverager(scale=0.5))
    seen: list[tuple[int, str]] = []
    loop.before_step = lambda: seen.append((loop.boundary, loop.hash()))
    for t in range(2):
        _train_inner(loop, t)
        loop.end_round(t)
    assert [b for b, _ in seen] == [0, 1]
    before_drain = loop.hash()
    assert loop.drain().applied_round == 1
    assert [b for b, _ in seen] == [0, 1] and loop.hash() != before_drain


def test_delayed_mode_launches_round_t_before_waiting_for_round_t_minus_1():
    averager = RecordingAverager()
    loop = _make_loop("delayed", averager)
    for t in range(3):
        _train_inner(loop, t)
        loop.end_round(t)
    loop.drain()
    assert averager.events == [
        ("launch", 0),
        ("launch", 1), ("wait", 0), ("resolve", 0),
        ("launch", 2), ("wait", 1), ("resolve", 1),
        ("wait", 2), ("resolve", 2),
    ]  # fmt: skip


def test_delayed_and_sync_differ_only_by_the_one_round_shift():
    # With the same per-round deltas, delayed after drain applied the same averages as sync,
    # one round later each; the final theta_g is the same.
    sync, delayed = _make_loop("sync", RecordingAverager()), _make_loop("delayed", RecordingAverager())
    for t in range(len(DELTAS)):
        for loop in (sync, delayed):
            _train_inner(loop, t)
            loop.end_round(t)
    delayed.drain()
    assert _theta(delayed) == pytest.approx(_theta(sync), abs=1e-6)


def test_load_into_model_copies_theta_g_into_the_params():
    loop = _make_loop("sync", RecordingAverager())
    _train_inner(loop, 0)
    loop.end_round(0)
    loop.load_into_model()
    for p, g in zip(loop.params, loop.theta_g):
        assert torch.equal(p.detach(), g)
        assert p.data_ptr() != g.data_ptr()


def test_the_default_outer_lr_follows_the_mode():
    sync = OuterLoop([torch.zeros(1)], OuterConfig(mode="sync"), RecordingAverager())
    delayed = OuterLoop([torch.zeros(1)], OuterConfig(mode="delayed"), RecordingAverager())
    assert sync.optimizer.lr == 1.0
    assert delayed.optimizer.lr == 0.1


# ----- state -----------------------------------------------------------------------------


def _through_disk(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_round_trips_theta_g_momentum_and_the_pending_average():
    original = _make_loop("delayed", RecordingAverager(resolve="at_launch"))
    for t in range(2):
        _train_inner(original, t)
        original.end_round(t)
    state = _through_disk(original.state_dict())
    assert state["pending"] is not None and state["pending"]["round"] == 1

    restored = OuterLoop([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))],
                         OuterConfig(mode="delayed", lr=LR, momentum=MU), RecordingAverager(resolve="at_launch"))
    restored.load_state_dict(state)
    assert restored.hash() == original.hash()
    assert all(torch.equal(a, b) for a, b in zip(restored.optimizer.buffers, original.optimizer.buffers))

    for loop in (original, restored):
        _train_inner(loop, 2)
        outcome = loop.end_round(2)
        assert outcome.applied_round == 1
    assert restored.hash() == original.hash()
    assert restored.drain().applied_round == 2
    original.drain()
    assert restored.hash() == original.hash()


def test_state_dict_without_a_pending_average_round_trips():
    original = _make_loop("sync", RecordingAverager())
    _train_inner(original, 0)
    original.end_round(0)
    state = _through_disk(original.state_dict())
    assert state["pending"] is None
    restored = _make_loop("sync", RecordingAverager())
    restored.load_state_dict(state)
    assert restored.hash() == original.hash()
    assert restored.pending is None


def test_a_checkpoint_taken_while_an_average_is_in_flight_names_the_round_it_lacks():
    # At a round boundary in delayed mode, round t's all-reduce is still running when the
    # worker checkpoints (waiting for it would stall training for the whole all-reduce).
    # The checkpoint must not pretend it has that average: it records which round is
    # missing, so a resumed swarm worker downloads the stage group's state instead of
    # silently skipping round t's average.
    original = _make_loop("delayed", RecordingAverager(resolve="on_wait"))
    for t in range(2):
        _train_inner(original, t)
        original.end_round(t)
    state = _through_disk(original.state_dict())
    assert state["pending"] is None
    assert state["pending_lost"] == 1
    restored = _make_loop("delayed", RecordingAverager(resolve="on_wait"))
    restored.load_state_dict(state)
    assert restored.pending_lost == 1
    assert restored.hash() == original.hash()


@pytest.mark.parametrize("mode", ["delayed", "streaming"])
def test_a_worker_resumed_where_nobody_has_the_average_in_flight_applies_its_own_pseudo_gradient_as_if_alone(mode):
    # a lone peer (its "average" is its own pseudo-gradient) checkpointed while that exchange was in flight: resumed
    # with nobody to take the average from, it applies its own and goes on bit for bit as if never interrupted
    original = _make_loop(mode, RecordingAverager(scale=1.0, resolve="on_wait"))
    for t in range(2):
        _train_inner(original, t)
        original.end_round(t)
    state = _through_disk(original.state_dict())
    assert state["pending_lost"] == 1 and state["pending_own"] is not None
    restored = _make_loop(mode, RecordingAverager(scale=1.0, resolve="on_wait"))
    restored.load_state_dict(state)
    assert restored.forget_lost_pending() == (1, True)
    assert restored.pending_lost is None
    for loop in (original, restored):
        _train_inner(loop, 2)
        assert loop.end_round(2).applied_round == 1
    assert restored.hash() == original.hash()
    # an older checkpoint without the own pseudo-gradient: the average is dropped, as before
    del state["pending_own"]
    old = _make_loop(mode, RecordingAverager(scale=1.0, resolve="on_wait"))
    old.load_state_dict(state)
    assert old.forget_lost_pending() == (1, False) and old.pending is None


def test_a_checkpoint_taken_after_the_average_arrived_carries_it():
    original = _make_loop("delayed", RecordingAverager(resolve="at_launch"))
    for t in range(2):
        _train_inner(original, t)
        original.end_round(t)
    state = _through_disk(original.state_dict())
    assert state["pending_lost"] is None
    restored = _make_loop("delayed", RecordingAverager(resolve="at_launch"))
    restored.load_state_dict(state)
    assert restored.pending_lost is None
    for loop in (original, restored):
        _train_inner(loop, 2)
        assert loop.end_round(2).applied_round == 1
    assert restored.hash() == original.hash()


def test_loop_hash_covers_theta_g_and_the_momentum():
    loop = _make_loop("sync", RecordingAverager())
    zeros = [torch.zeros_like(torch.tensor(t)) for t in THETA0]
    assert loop.hash() == state_hash([*(torch.tensor(t) for t in THETA0), *zeros])
    _train_inner(loop, 0)
    loop.end_round(0)
    assert loop.hash() == state_hash([*loop.theta_g, *loop.optimizer.buffers])


# ----- eager and own: the shared state moves as in delayed, each peer starts from its own correction ------------
def _start(loop):
    """What the next round trains from (load_into_model)."""
    loop.load_into_model()
    return [x for p in loop.params for x in p.detach().flatten().tolist()]


@pytest.mark.parametrize("mode", ["eager", "own"])
def test_eager_and_own_move_theta_g_exactly_as_delayed_does(mode):
    delayed, other = _make_loop("delayed", RecordingAverager(scale=0.5)), _make_loop(mode, RecordingAverager(scale=0.5))
    for t in range(len(DELTAS)):
        for loop in (delayed, other):
            _train_inner(loop, t)  # each round's delta is DELTAS[t], measured from the round's own start
            loop.end_round(t)
        # the same averages (each peer's delta is DELTAS[t] up to the rounding of start - theta_local)
        assert _theta(other) == pytest.approx(_theta(delayed), abs=1e-6), "a peer's correction reached theta_g"


def test_own_starts_each_round_from_theta_g_minus_its_own_fresh_delta():
    loop = _make_loop("own", RecordingAverager(scale=0.5))
    for t in range(len(DELTAS)):
        _train_inner(loop, t)
        loop.end_round(t)
        expected = [g - d for g, d in zip(_theta(loop), _flat(DELTAS[t]))]
        assert _start(loop) == pytest.approx(expected, abs=1e-6)


def test_eager_starts_from_the_step_of_the_proxy_that_swaps_its_stale_contribution_for_the_fresh_one():
    group = 3
    loop = _make_loop("eager", RecordingAverager(scale=0.5, group_size=group))
    previous = [0.0] * len(_flat(DELTAS[0]))
    for t in range(len(DELTAS)):
        _train_inner(loop, t)
        loop.end_round(t)
        fresh = _flat(DELTAS[t])
        n = 1 if t == 0 else group  # round 0 applies no average: the proxy is this peer's own delta
        # theta_start - theta_g = -lr (1 + mu) (proxy - Delta_{t-1}) = -lr (1 + mu) (delta_t - delta_{t-1}) / N
        expected = [g - LR * (1 + MU) * (d - p) / n for g, d, p in zip(_theta(loop), fresh, previous)]
        assert _start(loop) == pytest.approx(expected, abs=1e-6)
        previous = fresh


@pytest.mark.parametrize("mode", ["eager", "own"])
def test_a_peer_that_takes_the_swarms_state_starts_from_theta_g_without_a_correction(mode):
    loop = _make_loop(mode, RecordingAverager(resolve="at_launch"))
    for t in range(2):
        _train_inner(loop, t)
        loop.end_round(t)
    assert _start(loop) != pytest.approx(_theta(loop))
    loop.load_state(loop.state())
    assert _start(loop) == _theta(loop)


def test_a_joiner_takes_theta_g_while_the_average_is_in_flight_and_applies_it_when_it_follows():
    """STATE_NOW: the donor's state at its boundary, the average of the round before left out while in
    flight; the joiner trains on it and its next boundary waits for that average as for its own."""
    donor = _make_loop("delayed", RecordingAverager(scale=0.5))
    for t in range(2):
        _train_inner(donor, t)
        donor.end_round(t)
    assert donor.state() is None  # round 1's average is in flight: no complete state to serve
    now = donor.state(now=True)
    assert now.boundary == 2 and now.follows == 1 and now.pending is None and now.hash() == donor.hash()
    joiner = _make_loop("delayed", RecordingAverager(scale=0.5))
    with pytest.raises(ValueError, match="needs it to follow"):
        joiner.load_state(now)
    follows = Future()
    joiner.load_state(now, follows)
    assert joiner.state() is None and joiner.state(now=True).follows == 1
    for loop in (donor, joiner):
        _train_inner(loop, 2)
    applied = donor.end_round(2).applied[0]
    assert applied.round == 1
    ended = threading.Thread(target=joiner.end_round, args=(2,))
    ended.start()
    ended.join(timeout=0.3)
    assert ended.is_alive()  # the boundary waits for the average that follows
    follows.set_result(applied.average)
    ended.join(timeout=10)
    assert not ended.is_alive() and joiner.boundary == donor.boundary == 3
    assert joiner.hash() == donor.hash()


def test_the_mode_defaults_follow_the_measurements():
    assert OuterConfig(mode="own").effective_lr == 0.35 and OuterConfig(mode="own").effective_momentum == 0.7
    assert OuterConfig(mode="eager").effective_lr == 0.2 and OuterConfig(mode="eager").effective_momentum == 0.9


# ----- streaming -------------------------------------------------------------------------

ALPHA = 0.5


def _streaming_loop(averager, *, fragments=((0,), (1,)), tau=1, alpha=ALPHA):
    params = [torch.nn.Parameter(torch.tensor(t)) for t in THETA0]
    cfg = OuterConfig(mode="streaming", lr=LR, momentum=MU, fragments=len(fragments), overlap_steps=tau, merge_alpha=alpha)
    return OuterLoop(params, cfg, averager, fragments=fragments)


def _step_inner(loop, delta):
    """One inner step moving the params by -delta (nested like THETA0)."""
    with torch.no_grad():
        for p, d in zip(loop.params, delta):
            p.sub_(torch.tensor(d))


def _params(loop):
    return [x for p in loop.params for x in p.detach().flatten().tolist()]


def test_streaming_averages_one_fragment_per_round_against_theta_g_and_merges_it_at_step_tau_with_alpha():
    # two fragments: tensor 0 syncs in odd rounds, tensor 1 in even ones (fragments.fragment_of: (s + 1) mod P)
    averager = RecordingAverager(scale=0.5)
    loop = _streaming_loop(averager, tau=1)
    loop.load_into_model()
    hand = [HandNesterov(_flat(THETA0[0]), LR, MU), HandNesterov(_flat(THETA0[1]), LR, MU)]
    local = [_flat(THETA0[0]), _flat(THETA0[1])]
    sent: dict[int, list] = {}  # fragment -> the pseudo-gradient it sent in the round before (read from round 1)
    for s in range(len(DELTAS)):
        fragment = (s + 1) % 2
        for step, delta in enumerate((DELTAS[s], DELTAS[(s + 1) % len(DELTAS)])):  # two inner steps per sync round
            _step_inner(loop, delta)
            local = [[x - d for x, d in zip(xs, _flat(ds))] for xs, ds in zip(local, delta)]
            loop.after_inner_step(step + 1)
            if step + 1 == 1 and s > 0:  # tau = 1: the last round's fragment merges its theta_g'
                last = s % 2  # fragment of round s - 1
                preview = HandNesterov(hand[last].theta, LR, MU)
                preview.buf = list(hand[last].buf)
                preview.step([0.5 * x for x in sent[last]])
                local[last] = [ALPHA * x + (1 - ALPHA) * g for x, g in zip(local[last], preview.theta)]
            assert _params(loop) == pytest.approx(local[0] + local[1], abs=1e-6)
        outcome = loop.end_round(s)
        if s > 0:  # commits round s - 1's average to theta_g: only its fragment moves
            hand[s % 2].step([0.5 * x for x in sent[s % 2]])
            assert outcome.applied_round == s - 1
        sent = {fragment: [g - x for g, x in zip(hand[fragment].theta, local[fragment])]}
        assert [c.round for c in averager.calls] == list(range(s + 1))
        assert len(averager.calls[-1].tensors) == 1  # one fragment's pseudo-gradient, no more
        assert averager.calls[-1].tensors[0].flatten().tolist() == pytest.approx(sent[fragment], abs=1e-6)
        assert _theta(loop) == pytest.approx(hand[0].theta + hand[1].theta, abs=1e-6)


def test_streaming_waits_for_the_average_at_step_tau_not_before():
    averager = RecordingAverager(scale=0.5)
    loop = _streaming_loop(averager, tau=2)
    loop.load_into_model()
    loop.end_round(0)
    loop.after_inner_step(1)
    assert ("wait", 0) not in averager.events
    loop.after_inner_step(2)
    assert ("wait", 0) in averager.events
    loop.after_inner_step(2)  # merged once only
    assert averager.events.count(("wait", 0)) == 1


def test_streaming_prepares_its_merge_off_the_training_thread_as_soon_as_the_average_arrives():
    # on a GPU the preview (theta_g after the outer step, on the CPU) cost the training thread seconds per merge
    loop = _streaming_loop(RecordingAverager(scale=0.5), tau=2)
    threads = []
    preview = loop.optimizer.preview
    loop.optimizer.preview = lambda *a, **k: threads.append(threading.current_thread().name) or preview(*a, **k)
    loop.load_into_model()
    _step_inner(loop, DELTAS[0])
    loop.end_round(0)
    pending = loop.pending
    loop.averager.resolve(0)
    merged = pending.preview.result(timeout=10)  # ready before step tau asks for it
    assert threads == ["merge-preview_0"]
    (synced,) = loop.fragment_indices(0)
    want = [p.detach().clone() for p in loop.params]
    want[synced] = want[synced] * ALPHA + merged[0] * (1 - ALPHA)
    loop.after_inner_step(2)
    assert threads == ["merge-preview_0"], "the training thread computed the preview again"
    assert all(torch.equal(p.detach(), w) for p, w in zip(loop.params, want))  # the synced fragment merged only


def test_streaming_keeps_the_trained_weights_across_rounds_and_starts_from_theta_g_after_a_new_state():
    loop = _streaming_loop(RecordingAverager(resolve="at_launch"))
    loop.load_into_model()
    _step_inner(loop, DELTAS[0])
    loop.end_round(0)
    trained = _params(loop)
    loop.load_into_model()
    assert _params(loop) == trained  # not reset to theta_g, unlike the other modes
    loop.load_state(loop.state())
    loop.load_into_model()
    assert _params(loop) == _theta(loop)


def test_the_shared_model_is_evaluated_in_every_mode_and_the_trained_weights_come_back():
    loop = _streaming_loop(RecordingAverager(resolve="at_launch"))
    loop.load_into_model()
    _step_inner(loop, DELTAS[0])
    trained = _params(loop)
    with loop.theta_g_in_model():
        assert _params(loop) == _theta(loop)
    assert _params(loop) == trained


def test_a_streaming_sync_changes_only_its_fragments_hash():
    loop = _streaming_loop(RecordingAverager(scale=0.5, resolve="at_launch"))
    loop.load_into_model()
    _step_inner(loop, DELTAS[0])
    loop.end_round(0)  # fragment 1
    before = loop.fragment_hashes()
    _step_inner(loop, DELTAS[1])
    loop.end_round(1)  # applies round 0's average: fragment 1 (tensor 1) moves, fragment 0 stays
    after = loop.fragment_hashes()
    assert after[0] == before[0] and after[1] != before[1]


def test_streaming_settings_are_checked():
    from dilocox_p2p.config import Config, InnerConfig
    from dilocox_p2p.errors import ConfigError

    with pytest.raises(ConfigError, match="only in mode streaming"):
        OuterConfig(mode="delayed", fragments=2)
    with pytest.raises(ConfigError, match="multiple of it"):
        Config(inner=InnerConfig(steps=10), outer=OuterConfig(mode="streaming", fragments=3))
    with pytest.raises(ConfigError, match="at most inner.steps / fragments = 5"):
        Config(inner=InnerConfig(steps=10), outer=OuterConfig(mode="streaming", fragments=2, overlap_steps=6))
    with pytest.raises(ConfigError, match=r"merge_alpha"):
        OuterConfig(mode="streaming", merge_alpha=1.0)


def test_a_checkpoint_keeps_the_weights_a_peer_trains_from_so_that_resuming_goes_on_exactly():
    loop = _streaming_loop(RecordingAverager(scale=0.5, resolve="at_launch"))
    loop.load_into_model()
    _step_inner(loop, DELTAS[0])
    loop.end_round(0)
    trained = _params(loop)
    resumed = _streaming_loop(RecordingAverager())
    resumed.load_state_dict(_through_disk(loop.state_dict()))
    resumed.load_into_model()
    assert _params(resumed) == trained and _theta(resumed) == _theta(loop)

    own = _make_loop("own", RecordingAverager(scale=0.5))
    for t in range(2):
        _train_inner(own, t)
        own.end_round(t)
    again = _make_loop("own", RecordingAverager())
    again.load_state_dict(_through_disk(own.state_dict()))
    assert _start(again) == _start(own) != _theta(own)
