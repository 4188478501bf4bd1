"""Codecs for pseudo-gradients: quantization, top-k, low-rank and error feedback, as properties.

    pytest tests/unit/test_compression.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocox_p2p.compression.feedback import ErrorFeedback
from dilocox_p2p.compression.lowrank import adapt_rank, basis, initial_q, local_basis, reconstruct
from dilocox_p2p.compression.quantize import dequantize, dequantize_fp4, error_bound, quantize, quantize_fp4
from dilocox_p2p.compression.topk import decode_topk, encode_topk

pytestmark = pytest.mark.unit

shapes = st.lists(st.integers(1, 300), min_size=1, max_size=2).map(tuple)


def _normal(shape, seed, scale=1e-2):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape) * scale * np.exp(rng.standard_normal(shape))  # heavy-ish tails
    return torch.from_numpy(values.astype(np.float32))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**32 - 1), bits=st.sampled_from([4, 8]),
       block=st.sampled_from([1, 7, 64, 256]))  # fmt: skip
def test_blockwise_quantization_errs_at_most_half_a_block_scale(shape, seed, bits, block):
    x = _normal(shape, seed)
    decoded = dequantize(quantize(x, bits=bits, block=block))
    assert decoded.shape == x.shape and decoded.dtype == torch.float32
    bound = error_bound(x, bits=bits, block=block)
    assert torch.all((decoded - x).abs() <= bound * (1 + 1e-6) + 1e-30)
    # and the scales are tight: within a bf16 rounding of absmax / qmax
    qmax = 127 if bits == 8 else 7
    blocks = torch.nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % block)).view(-1, block)
    tight = (blocks.abs().amax(1) / qmax / 2).repeat_interleave(block)[: x.numel()].reshape(x.shape)
    assert torch.all(bound <= tight * (1 + 2**-6) + 1e-30)


def test_int4_travels_two_codes_to_a_byte_and_int8_one():
    x = _normal((1000,), 0)
    assert quantize(x, bits=8, block=64).nbytes == 1000 + 2 * 16
    assert quantize(x, bits=4, block=64).nbytes == 500 + 2 * 16


def test_fp4_e3m0_codes_round_trip_to_hand_computed_powers_of_two():
    # one block of 8: absmax 1.0 rounds up to the bf16 scale 1.0078125 (1 + 2^-7)
    x = torch.tensor([1.0, -0.5, 0.26, 0.0, -0.012, 0.004, 0.75, -1.0])
    q = quantize_fp4(x, block=8)
    s = 1.0078125
    # the nearest of 0, s/64, s/32, ..., s/2, s: 0.26 -> s/4; 0.012 -> s/64 (0.0157 is nearer than 0);
    # 0.004 -> 0 (nearer than s/64); 0.75 -> s/2 (0.504 is 0.246 away, s is 0.258 away)
    expected = torch.tensor([s, -s / 2, s / 4, 0.0, -s / 64, 0.0, s / 2, -s])
    assert torch.equal(dequantize_fp4(q), expected)
    assert len(q.codes) == 4 and len(q.scales) == 2  # 4 bits a value, one bf16 scale a block
    codes = np.frombuffer(q.codes, dtype=np.uint8)
    assert codes[0] & 0x0F == 7 and codes[0] >> 4 == 8 + 6  # +2^0, then -2^-1: sign bit 3, exponent e - 7


def test_fp4_keeps_every_value_within_its_block_scale_and_decodes_to_the_same_bits_from_any_slice():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=gen) * torch.logspace(-3, 1, 1000)
    q = quantize_fp4(x, block=64)
    decoded = dequantize_fp4(q)
    scales = torch.from_numpy(np.frombuffer(q.scales, dtype=np.int16).copy()).view(torch.bfloat16).float()
    per_value = scales.repeat_interleave(64)[:1000]
    assert bool(((decoded - x).abs() <= per_value / 2).all()), "an fp4 error above half a block scale"
    assert bool((torch.sign(decoded) * torch.sign(x) >= 0).all()), "a sign flipped"
    assert torch.equal(dequantize_fp4(quantize_fp4(torch.zeros(10), block=4)), torch.zeros(10))


def test_quantizing_zeros_gives_zeros():
    assert torch.equal(dequantize(quantize(torch.zeros(3, 5), bits=4)), torch.zeros(3, 5))


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 20000), seed=st.integers(0, 2**32 - 1), density=st.sampled_from([1 / 64, 0.03, 0.25, 1.0]),
       bits=st.sampled_from([2, 3, 4]), chunk=st.sampled_from([64, 4096]))  # fmt: skip
def test_top_k_keeps_exactly_the_k_largest_of_each_chunk(numel, seed, density, bits, chunk):
    x = torch.from_numpy(np.random.default_rng(seed).permutation(numel).astype(np.float32) + 1)  # distinct magnitudes
    x = torch.where(torch.from_numpy(np.random.default_rng(seed + 1).random(numel) < 0.5), -x, x)
    message = encode_topk(x, chunk=chunk, density=density, bits=bits)
    decoded = decode_topk(message, x.shape)
    layout = message.layout
    for c in range(layout.n_chunks):
        part, got = x[c * layout.chunk : (c + 1) * layout.chunk], decoded[c * layout.chunk : (c + 1) * layout.chunk]
        k = min(layout.k, part.numel())
        expected = set(torch.topk(part.abs(), k).indices.tolist())
        assert set(torch.nonzero(got).reshape(-1).tolist()) == expected
        assert torch.all(torch.sign(got[list(expected)]) == torch.sign(part[list(expected)]))


def test_top_k_message_at_the_sparseloco_setting_is_about_195x_smaller_than_fp32():
    x = _normal((512, 2048), 1)
    message = encode_topk(x, chunk=4096, density=64 / 4096, bits=2)
    ratio = 4 * x.numel() / message.nbytes
    assert 190 < ratio < 200, ratio


def test_top_k_two_bit_levels_are_the_means_of_the_smaller_and_larger_halves():
    x = torch.tensor([0.0, 1.0, -2.0, 3.0, 0.1, -4.0, 0.0, 0.0])
    decoded = decode_topk(encode_topk(x, chunk=8, density=0.5, bits=2), x.shape)
    assert decoded.tolist() == [0.0, 1.5, -1.5, 3.5, 0.0, -3.5, 0.0, 0.0]


def test_a_malformed_top_k_message_is_refused():
    message = encode_topk(_normal((5000,), 2), chunk=4096, density=1 / 64)
    broken = type(message)(**{**message.__dict__, "high": bytes(len(message.high))})
    with pytest.raises(ValueError, match="index field"):
        decode_topk(broken, (5000,))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 300), m=st.integers(2, 300), true_rank=st.integers(1, 6), extra=st.integers(0, 3),
       seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_low_rank_is_exact_for_a_matrix_of_rank_at_most_r(n, m, true_rank, extra, seed):
    rank = min(true_rank + extra, n, m)
    true_rank = min(true_rank, rank)
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((n, true_rank)), rng.standard_normal((m, true_rank))
    matrix = torch.from_numpy((a @ b.T * 1e-3).astype(np.float32))
    q = initial_q("run", 0, "w", m, rank)
    p = matrix @ q  # one peer: the average is its own P
    base = basis(p)
    approx = reconstruct(base, matrix.T @ local_basis(base))
    # as good as a float64 QR of the same P (whose float32 rounding limits both, by P's condition)
    reference, _ = np.linalg.qr(p.double().numpy())
    ref_err = np.linalg.norm(reference @ (reference.T @ matrix.double().numpy()) - matrix.double().numpy())
    assert torch.linalg.norm(approx - matrix) <= 2 * ref_err + 1e-5 * torch.linalg.norm(matrix)


def test_low_rank_basis_is_orthonormal_and_skips_dependent_columns():
    rng = np.random.default_rng(3)
    p = rng.standard_normal((200, 4))
    p[:, 2] = p[:, 0] * 2 - p[:, 1]  # a dependent column
    base = basis(torch.from_numpy(p.astype(np.float32)))
    assert base.chol[2, 2] == 0.0
    b = local_basis(base)
    gram = (b.T @ b).double()
    assert torch.allclose(gram, torch.diag(torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)), atol=1e-5)


def test_low_rank_of_a_zero_matrix_is_zero():
    base = basis(torch.zeros(30, 4))
    assert torch.equal(reconstruct(base, torch.ones(20, 4)), torch.zeros(30, 20))


def test_the_rank_grows_below_the_energy_target_and_shrinks_well_above_it():
    assert adapt_rank(16, 0.5, target=0.8, low=4, high=64) == 20
    assert adapt_rank(16, 0.85, target=0.8, low=4, high=64) == 16
    assert adapt_rank(16, 0.95, target=0.8, low=4, high=64) == 14
    assert adapt_rank(64, 0.1, target=0.8, low=4, high=64) == 64
    assert adapt_rank(4, 0.99, target=0.8, low=4, high=64) == 4


def test_initial_q_is_seeded_by_run_round_and_name():
    assert torch.equal(initial_q("r", 3, "w", 10, 2), initial_q("r", 3, "w", 10, 2))
    assert not torch.equal(initial_q("r", 3, "w", 10, 2), initial_q("r", 4, "w", 10, 2))
    assert not torch.equal(initial_q("r", 3, "w", 10, 2), initial_q("r", 3, "v", 10, 2))


def _codecs():
    def topk(x):
        return decode_topk(encode_topk(x, chunk=256, density=1 / 32, bits=2), x.shape)

    def int4(x):
        return dequantize(quantize(x, bits=4, block=64))

    return {"topk": topk, "int4": int4}


@pytest.mark.parametrize("codec", ["topk", "int4"])
def test_with_error_feedback_the_decoded_updates_add_up_to_the_true_ones(codec):
    compress = _codecs()[codec]
    feedback = ErrorFeedback([torch.zeros(40, 64)], decay=1.0)
    true_sum, sent_sum = torch.zeros(40, 64, dtype=torch.float64), torch.zeros(40, 64, dtype=torch.float64)
    residuals = []
    for step in range(100):
        delta = _normal((40, 64), step)
        true_sum += delta.double()
        (buffer,) = feedback.absorb([delta])
        decoded = compress(buffer)
        feedback.sent([decoded])
        sent_sum += decoded.double()
        residuals.append(float(torch.linalg.norm(true_sum - sent_sum) / torch.linalg.norm(true_sum)))
        # nothing is lost: what was not sent yet is exactly in the buffer
        assert torch.allclose(true_sum - sent_sum, feedback.buffers[0].double(), atol=1e-5)
    assert max(residuals[50:]) < 0.5 and residuals[-1] < residuals[9]  # bounded, and shrinking relative to the sum


def test_error_feedback_round_trips_through_a_state_dict():
    feedback = ErrorFeedback([torch.zeros(3, 4), torch.zeros(5)], decay=0.95)
    feedback.absorb([torch.ones(3, 4), torch.ones(5)])
    again = ErrorFeedback([torch.zeros(3, 4), torch.zeros(5)], decay=0.95)
    again.load_state_dict(feedback.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.buffers, feedback.buffers))
    with pytest.raises(ValueError, match="do not fit"):
        ErrorFeedback([torch.zeros(2)]).load_state_dict(feedback.state_dict())


# ----- one stage's codec, three members in one process ---------------------------------------
from dilocox_p2p.average import all_finite  # noqa: E402
from dilocox_p2p.compression.codec import StageCodec  # noqa: E402
from dilocox_p2p.config import CompressionConfig  # noqa: E402

SHAPES = [torch.Size((96, 64)), torch.Size((64,)), torch.Size((64, 200)), torch.Size((3, 5))]
NAMES = ["a.weight", "a.bias", "b.weight", "c.weight"]


def _exchange(codecs, deltas, round=0, tamper=None):
    rounds = [c.begin(round, d) for c, d in zip(codecs, deltas)]
    gathered = [r.message(1) for r in rounds]
    if tamper is not None:
        gathered = tamper(gathered)
    if codecs[0].phases == 2:
        gathered = [r.message(2, gathered) for r in rounds]
    return [r.average(gathered, own=i) for i, r in enumerate(rounds)]


def _deltas(seed, low_rank=None):
    rng = np.random.default_rng(seed)
    out = []
    for shape in SHAPES:
        if low_rank and len(shape) == 2:
            a, b = rng.standard_normal((shape[0], low_rank)), rng.standard_normal((shape[1], low_rank))
            out.append(torch.from_numpy((a @ b.T * 1e-3).astype(np.float32)))
        else:
            out.append(torch.from_numpy((rng.standard_normal(tuple(shape)) * 1e-3).astype(np.float32)))
    return out


@pytest.mark.parametrize("kind", ["fp16", "int8", "fp4", "topk", "lowrank"])
def test_every_member_decodes_the_group_average_to_the_same_bits(kind):
    cfg = CompressionConfig(kind=kind, rank=4, rank_max=8, energy_target=0.0, topk_chunk=256, topk_density=0.25)
    codecs = [StageCodec(cfg, NAMES, SHAPES, run_id="r") for _ in range(3)]
    deltas = [_deltas(seed, low_rank=1 if kind == "lowrank" else None) for seed in range(3)]
    results = _exchange(codecs, deltas)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0].tensors, other.tensors))
    assert results[0].used == [0, 1, 2] and not results[0].rejected
    true_mean = [sum(d[i] for d in deltas) / 3 for i in range(len(SHAPES))]
    tolerance = {"fp16": 1e-3, "int8": 2e-2, "fp4": 0.35, "topk": 0.9, "lowrank": 0.2}[kind]
    for i, (got, want) in enumerate(zip(results[0].tensors, true_mean)):
        assert got.shape == want.shape
        err = float(torch.linalg.norm(got - want) / torch.linalg.norm(want))
        assert err < tolerance, f"{kind} tensor {NAMES[i]}: relative error {err:.3f}"


def test_low_rank_recovers_the_exact_mean_of_low_rank_deltas_and_adapts_its_rank():
    cfg = CompressionConfig(kind="lowrank", rank=4, rank_min=1, rank_max=8, energy_target=0.5, factor_bits=8)
    codecs = [StageCodec(cfg, NAMES, SHAPES, run_id="r") for _ in range(3)]
    assert codecs[0].lowrank == [True, False, True, False]  # the bias and the 3x5 matrix are sent whole
    deltas = [_deltas(seed, low_rank=1) for seed in range(3)]  # the mean has rank <= 3 < 4
    (first, *_) = _exchange(codecs, deltas)
    mean = sum(d[0] for d in deltas) / 3
    assert float(torch.linalg.norm(first.tensors[0] - mean) / torch.linalg.norm(mean)) < 0.03  # int8 factors
    metrics = codecs[0].metrics()
    assert metrics["energy"]["a.weight"] > 0.95 and metrics["ranks"]["a.weight"] == 4 - max(1, 4 // 8)
    assert all(c.ranks == codecs[0].ranks for c in codecs)


def test_a_low_rank_phase_2_message_computed_in_another_basis_is_left_out_and_costs_its_author_no_strike():
    """A member that missed a phase-1 message computes its basis from another set: its Q is in another basis,
    and was averaged with the others' silently (a wrong mean on every member)."""
    from dilocox_p2p.compression.codec import NO_FAULT, OTHER_BASIS

    cfg = CompressionConfig(kind="lowrank", rank=4, rank_max=8, energy_target=0.0)
    codecs = [StageCodec(cfg, NAMES, SHAPES, run_id="r") for _ in range(3)]
    rounds = [c.begin(0, _deltas(seed, low_rank=1)) for seed, c in enumerate(codecs)]
    first = [r.message(1) for r in rounds]
    seen = [first, first, [None, first[1], first[2]]]  # member 2 never got member 0's phase-1 message
    second = [r.message(2, s) for r, s in zip(rounds, seen)]
    results = [r.average(second, own=i) for i, r in enumerate(rounds)]
    assert results[0].used == results[1].used == [0, 1] and results[0].rejected == {2: OTHER_BASIS}
    assert results[2].used == [2] and results[2].rejected[0] == OTHER_BASIS == results[2].rejected[1]
    assert all(torch.equal(a, b) for a, b in zip(results[0].tensors, results[1].tensors))
    assert OTHER_BASIS in NO_FAULT  # a loss on the way, not a forgery: nobody strikes its author


def test_one_members_claimed_energies_do_not_steer_the_groups_ranks():
    from dilocox_p2p.compression.payload import frame, unframe

    cfg = CompressionConfig(kind="lowrank", rank=4, rank_min=1, rank_max=8, energy_target=0.5)

    def ranks_after(forge):
        codecs = [StageCodec(cfg, NAMES, SHAPES, run_id="r") for _ in range(3)]
        rounds = [c.begin(0, _deltas(seed, low_rank=1)) for seed, c in enumerate(codecs)]
        first = [r.message(1) for r in rounds]
        second = [r.message(2, first) for r in rounds]
        if forge:  # member 2 claims its matrices hold 1e30 of energy, of which the basis kept nothing
            message, sections = unframe(second[2])
            message.energy_total[:] = [1e30] * len(message.energy_total)
            second[2] = frame(message, [[bytes(s)] for s in sections])
        [r.average(second, own=i) for i, r in enumerate(rounds)]
        assert all(c.ranks == codecs[0].ranks for c in codecs)
        return codecs[0].ranks, codecs[0].last_energy

    honest_ranks, honest_energy = ranks_after(forge=False)
    ranks, energy = ranks_after(forge=True)
    assert ranks == honest_ranks and all(e > 0.9 for e in energy.values()), (ranks, energy)


def test_a_malformed_or_non_finite_message_is_left_out_by_every_member():
    cfg = CompressionConfig(kind="int8")
    codecs = [StageCodec(cfg, NAMES, SHAPES, run_id="r") for _ in range(3)]

    def tamper(gathered):
        return [gathered[0], b"\x08garbage", gathered[2]]

    results = _exchange(codecs, [_deltas(s) for s in range(3)], tamper=tamper)
    assert all(r.used == [0, 2] and list(r.rejected) == [1] for r in results)
    assert all(torch.equal(a, b) for a, b in zip(results[0].tensors, results[2].tensors))
    assert not all_finite([torch.tensor([1.0, float("nan")])])


@pytest.mark.parametrize("kind", ["int8", "topk", "lowrank"])
def test_a_message_no_average_counted_stays_in_its_senders_buffer_whole_and_is_sent_again(kind):
    """Error feedback used to give a message up when it was encoded: one never averaged was lost for good."""
    cfg = CompressionConfig(kind=kind, rank=4, rank_max=8, energy_target=0.0, topk_chunk=256, topk_density=0.25)
    codecs = [StageCodec(cfg, NAMES, SHAPES, run_id="r") for _ in range(3)]
    deltas = [_deltas(seed, low_rank=1 if kind == "lowrank" else None) for seed in range(3)]

    def lost_on_the_way(gathered):  # nobody received member 0's message (its gather failed)
        return [None, *gathered[1:]]

    results = _exchange(codecs, deltas, tamper=lost_on_the_way)
    # low-rank: member 0's factors (phase 2) were averaged, its tensors sent whole (phase 1) were not
    assert all(r.used == ([0, 1, 2] if kind == "lowrank" else [1, 2]) and 0 in r.rejected for r in results)
    for i, (e, d) in enumerate(zip(codecs[0].feedback.buffers, deltas[0])):
        assert torch.equal(e, d) != codecs[0].lowrank[i], SHAPES[i]  # kept whole unless counted
    assert not torch.equal(codecs[1].feedback.buffers[1], deltas[1][1])  # a member whose message was averaged

    # a member that borrowed the group's average: its message leaves the buffer only if that average counted it
    for counted in (False, True):
        codec = StageCodec(cfg, NAMES, SHAPES, run_id="r")
        round_codec = codec.begin(0, deltas[0])
        blob = round_codec.message(1)
        round_codec.settle(counted)
        round_codec.settle(not counted)  # once per round: a second word changes nothing
        if not counted:
            assert all(torch.equal(e, d) for e, d in zip(codec.feedback.buffers, deltas[0]))
        elif kind != "lowrank":  # what left is exactly what every member decodes of the message
            sent = codecs[1].receive(blob, round=0, phase=1).pieces()
            assert all(torch.equal(e, d - m) for e, d, m in zip(codec.feedback.buffers, deltas[0], sent))


def test_what_error_feedback_sent_and_kept_adds_up_to_the_pseudo_gradients_with_rounds_never_averaged():
    cfg = CompressionConfig(kind="int8")
    codec = StageCodec(cfg, NAMES, SHAPES, run_id="r")
    total = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    delivered = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for round in range(12):
        delta = _deltas(round)
        total = [t + d.double() for t, d in zip(total, delta)]
        round_codec = codec.begin(round, delta)
        blob = round_codec.message(1)
        counted = round % 3 != 1  # every third round its message is never averaged
        if counted:
            delivered = [t + m.double() for t, m in zip(delivered, codec.receive(blob, round=round, phase=1).pieces())]
        round_codec.settle(counted)
    for t, sent, kept in zip(total, delivered, codec.feedback.buffers):
        assert torch.allclose(sent + kept.double(), t, atol=1e-6)


def test_a_round_begun_before_the_buffer_was_reset_gives_nothing_back_to_the_new_buffer():
    codec = StageCodec(CompressionConfig(kind="int8"), NAMES, SHAPES, run_id="r")
    round_codec = codec.begin(0, _deltas(0))
    round_codec.message(1)
    codec.reset()  # this peer moved on to the swarm's state while the round was in flight
    round_codec.settle(True)
    assert all(not bool(e.any()) for e in codec.feedback.buffers)


def test_error_feedback_and_warm_q_survive_a_checkpoint():
    cfg = CompressionConfig(kind="lowrank", rank=2, energy_target=0.0)
    codec = StageCodec(cfg, NAMES, SHAPES, run_id="r")
    _exchange([codec], [_deltas(0)])
    again = StageCodec(cfg, NAMES, SHAPES, run_id="r")
    again.load_state_dict(codec.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(again.feedback.buffers, codec.feedback.buffers))
    assert sorted(again.qs) == [0, 2] and all(torch.equal(again.qs[i], codec.qs[i]) for i in again.qs)


@pytest.mark.parametrize("shape", [(512, 1536), (64, 64), (256, 64), (2048, 2048)])
def test_the_automatic_rank_cap_keeps_every_factored_matrix_100x_below_fp32(shape):
    cfg = CompressionConfig(kind="lowrank", rank=1, energy_target=0.0)
    codec = StageCodec(cfg, ["w"], [torch.Size(shape)], run_id="r")
    cap = codec.rank_cap(0)
    codec = StageCodec(CompressionConfig(kind="lowrank", rank=cap, energy_target=0.0), ["w"], [torch.Size(shape)],
                       run_id="r")  # fmt: skip
    round_codec = codec.begin(0, [torch.randn(shape) * 1e-3])
    first = round_codec.message(1)
    second = round_codec.message(2, [first])
    assert len(first) + len(second) <= 4 * shape[0] * shape[1] / 100 + 128  # + framing: headers, the basis digest
    if min(shape) >= 512:
        assert cap >= 16  # and the cap is not needlessly low on real widths


@pytest.mark.parametrize("kind", ["fp16", "int8", "fp4", "topk", "lowrank"])
def test_encoding_and_averaging_a_slice_at_a_time_gives_the_bytes_of_the_whole_stage_at_once(kind, monkeypatch):
    """Slices are a memory bound only: messages, averages and error-feedback buffers are the same bits
    whatever the slice length (here 100 values: slices cross tensors, blocks and chunks start them)."""
    import dilocox_p2p.compression.payload as payload

    cfg = CompressionConfig(kind=kind, rank=4, rank_max=8, energy_target=0.0, topk_chunk=64, topk_density=0.25,
                            block=16, factor_bits=4)  # fmt: skip

    def run():
        codecs = [StageCodec(cfg, NAMES, SHAPES, run_id="r") for _ in range(3)]
        deltas = [_deltas(seed) for seed in range(3)]
        rounds = [c.begin(0, d) for c, d in zip(codecs, deltas)]
        gathered = [r.message(1) for r in rounds]
        if codecs[0].phases == 2:
            gathered = [r.message(2, gathered) for r in rounds]
        average = rounds[0].average(gathered, own=0)
        return gathered, average.tensors, codecs[0].feedback.buffers

    whole = run()
    monkeypatch.setattr(payload, "SLICE", 100)
    sliced = run()
    assert sliced[0] == whole[0]
    for a, b in zip(sliced[1] + sliced[2], whole[1] + whole[2]):
        assert torch.equal(a, b)


def test_a_quantized_message_whose_scales_would_overflow_is_refused():
    from dilocox_p2p.compression.codec import MessageRejected
    from dilocox_p2p.compression.payload import frame
    from dilocox_p2p.proto_gen import compression_pb2 as pb

    codec = StageCodec(CompressionConfig(kind="int8", block=64), ["w"], [torch.Size((64,))], run_id="r")
    huge = torch.tensor([3e38], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    payload = pb.EncodedTensor(shape=[64], quantized=pb.QuantizedTensor(bits=8, block=64))
    blob = frame(pb.CompressedMessage(codec="int8", round=0, phase=1, payload=payload), [[bytes(64)], [huge]])
    with pytest.raises(MessageRejected, match="NaN or Inf"):
        codec.receive(blob, round=0, phase=1)


def test_a_value_fp16_cannot_hold_is_sent_as_its_largest_and_the_rest_follows_in_later_rounds():
    """Beyond 65504 a cast to fp16 gives Inf: every member refused the message, struck its honest sender and
    the sender's buffer became -Inf for good. It is clamped instead; error feedback sends the rest."""
    codec = StageCodec(CompressionConfig(kind="fp16"), ["w"], [torch.Size((4,))], run_id="r")
    member = StageCodec(CompressionConfig(kind="fp16"), ["w"], [torch.Size((4,))], run_id="r")
    delta = torch.tensor([70000.0, -70000.0, 1.0, 0.0])
    delivered = torch.zeros(4)
    for round, d in enumerate([delta, torch.zeros(4), torch.zeros(4)]):
        round_codec = codec.begin(round, [d])
        blob = round_codec.message(1)
        delivered += member.receive(blob, round=round, phase=1).reader.read_all()  # refused: MessageRejected
        round_codec.settle(True)  # averaged: what it carried leaves the buffer
        assert all_finite(codec.feedback.buffers)
    assert torch.equal(delivered, delta)  # 65504 + 4496 (both exact in fp16), over two rounds


def test_an_error_feedback_buffer_never_holds_nan_or_inf():
    from dilocox_p2p.compression.codec import MessageRejected

    codec = StageCodec(CompressionConfig(kind="int8"), ["w"], [torch.Size((64,))], run_id="r")
    big = torch.full((64,), 3e38)
    codec.begin(0, [big]).settle(False)  # never averaged: it stays in the buffer
    codec.begin(1, [big]).settle(False)  # 6e38 is beyond fp32: held at its largest value
    assert all_finite(codec.feedback.buffers) and float(codec.feedback.buffers[0][0]) == torch.finfo(torch.float32).max
    held = codec.feedback.buffers[0].clone()
    hostile = codec.begin(2, [torch.full((64,), float("nan"))])  # a worker playing hostile (exchange._play_hostile)
    with pytest.raises(MessageRejected, match="NaN or Inf"):
        codec.receive(hostile.message(1), round=2, phase=1)
    hostile.settle(True)
    assert torch.equal(codec.feedback.buffers[0], held)  # the NaN never entered it, nor left anything out of it


@pytest.mark.parametrize("kind", ["int8", "fp4"])
def test_a_block_too_large_for_any_scale_is_clamped_and_still_received(kind):
    codec = StageCodec(CompressionConfig(kind=kind, block=64), ["w"], [torch.Size((64,))], run_id="r")
    delta = torch.full((64,), 3.4e38)  # near fp32's largest: its scale times 128 (what a receiver checks) overflows
    received = codec.receive(codec.begin(0, [delta]).message(1), round=0, phase=1).reader.read_all()
    assert bool(torch.isfinite(received).all()) and float(received.min()) > 1e35
    assert all_finite(codec.feedback.buffers)


ENCODED_OTHERWISE = {  # (what the sender encodes with, what the run uses): each pair lays out 4096 values alike
    "fp16 as int8": (dict(kind="fp16"), dict(kind="int8")),
    "int8 as low-rank at 4 bits": (dict(kind="int8"), dict(kind="lowrank", factor_bits=4)),
    "int8 in blocks of 32": (dict(kind="int8", block=32), dict(kind="int8", block=64)),
    "top-k of another density": (dict(kind="topk", topk_chunk=256, topk_density=1 / 32),
                                 dict(kind="topk", topk_chunk=256, topk_density=1 / 64)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ENCODED_OTHERWISE))
def test_a_payload_encoded_otherwise_than_the_run_says_is_refused_even_when_its_label_and_size_fit(case):
    from dilocox_p2p.compression.codec import MessageRejected
    from dilocox_p2p.compression.payload import frame, unframe

    sent, run = (CompressionConfig(**c) for c in ENCODED_OTHERWISE[case])
    shapes = [torch.Size((4096,))]  # a vector: low-rank sends it whole, quantized
    sender, receiver = (StageCodec(c, ["w"], shapes, run_id="r") for c in (sent, run))
    message, sections = unframe(sender.begin(0, [_normal((4096,), 0)]).message(1))
    message.codec = run.kind
    with pytest.raises(MessageRejected, match=f"this run's {run.kind} is"):
        receiver.receive(frame(message, [[bytes(s)] for s in sections]), round=0, phase=1)
    receiver.receive(receiver.begin(0, [_normal((4096,), 0)]).message(1), round=0, phase=1)  # its own: received


def test_a_top_k_message_with_a_repeated_index_is_refused():
    """Two kept values at one index would decode by scatter order, which may differ between machines."""
    from dilocox_p2p.compression.topk import SparseChunks, TopKLayout, _pack_uint, _unary_high

    layout = TopKLayout.of(8, chunk=8, density=0.5)  # k = 4, low bits 1
    index = np.array([[2, 2, 5, 7]])
    message = encode_topk(torch.arange(8.0), chunk=8, density=0.5)
    forged = SparseChunks(layout, message.bits, message.signs, message.levels, message.magnitudes,
                          _pack_uint((index & 1).reshape(-1), 1), _unary_high(index >> 1, layout))  # fmt: skip
    with pytest.raises(ValueError, match="strictly ascending"):
        decode_topk(forged, (8,))


@pytest.mark.parametrize("kind", ["fp16", "int8", "fp4", "topk", "lowrank"])
def test_a_received_message_is_read_in_place_without_copying_its_payload(kind):
    """The payload's sections are views of the received bytes (a message costs its size once)."""
    from dilocox_p2p.compression.payload import unframe

    cfg = CompressionConfig(kind=kind, rank=2, energy_target=0.0)
    blob = StageCodec(cfg, NAMES, SHAPES, run_id="r").begin(0, _deltas(0)).message(1)
    header, sections = unframe(blob)
    assert sections and all(s.obj is blob for s in sections)
    assert sum(s.nbytes for s in sections) + len(header.SerializeToString()) + 4 == len(blob)


@pytest.mark.parametrize("cut", ["header length", "header", "section", "extra byte"])
def test_a_message_framed_wrongly_is_refused_with_the_reason(cut):
    from dilocox_p2p.compression.codec import MessageRejected

    codec = StageCodec(CompressionConfig(kind="int8"), NAMES, SHAPES, run_id="r")
    blob = codec.begin(0, _deltas(0)).message(1)
    broken = {
        "header length": blob[:3],
        "header": (2**31).to_bytes(4, "little") + blob[4:],
        "section": blob[:-1],
        "extra byte": blob + b"\0",
    }[cut]
    with pytest.raises(MessageRejected, match="malformed"):
        codec.receive(broken, round=0, phase=1)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["fp16", "int8", "fp4", "topk", "lowrank"]), data=st.data())
def test_no_corruption_of_a_message_makes_receiving_it_fail_other_than_by_refusal(kind, data):
    """Flipped, cut or spliced bytes: `receive` either refuses (MessageRejected) or returns a message whose
    values are finite and of the stage's shapes; nothing else escapes."""
    from dilocox_p2p.compression.codec import MessageRejected

    cfg = CompressionConfig(kind=kind, rank=2, energy_target=0.0, topk_chunk=64, topk_density=0.25)
    codec = StageCodec(cfg, NAMES, SHAPES, run_id="r")
    blob = bytearray(codec.begin(0, _deltas(0)).message(1))
    for _ in range(data.draw(st.integers(1, 4))):
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(blob) - 1))
        if how == "flip":
            blob[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "cut":
            del blob[at : at + data.draw(st.integers(1, 16))]
        else:
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        if not blob:
            blob = bytearray(b"\0")
    try:
        received = codec.receive(bytes(blob), round=0, phase=1)
    except MessageRejected:
        return
    values = received.reader.read_all()
    assert values.numel() == received.layout.numel and bool(torch.isfinite(values).all())
