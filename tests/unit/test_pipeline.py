"""Pipeline correctness: M stage processes compute the loss and gradients of the whole model.

For M = 1, 2, 4 (1F1B; GPipe at 4; bf16 boundaries at 2) this starts M real processes (forked from a server that
imported this module: helpers/niced.py) joined by a gloo process group on loopback
(TCPStore on port 0), each running one `InnerTrainer.train_step` of its stage on the same
fixed batch, and compares every gradient with a single-process `GPT` reference.

Run: python -m pytest tests/unit/test_pipeline.py -q      (about 15 s on 2 CPU cores)
"""

from __future__ import annotations

import queue
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dilocox_p2p.config import load_config
from dilocox_p2p.inner import InnerTrainer
from dilocox_p2p.model import GPT, lm_loss
from tests.helpers import niced

pytestmark = pytest.mark.unit

BATCH, SEQ = 16, 128
_TIMEOUT_S = 120


def _config(n_stages: int, schedule: str = "1f1b", precision: str = "fp32"):
    overrides = {"model.stages": n_stages, "inner.grad_clip": 0.0, "inner.schedule": schedule, "inner.precision": precision}
    return load_config(overrides=overrides)


def _batch():
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    return inputs, targets


def _stage_process(rank: int, port: int, results, n_stages: int, schedule: str, precision: str) -> None:
    """One stage: evaluate, then one train step; send back loss and gradients as numpy."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n_stages)
    try:
        inputs, targets = _batch()
        trainer = InnerTrainer(_config(n_stages, schedule, precision), stage=rank, device=torch.device("cpu"))
        # Forward-only first, while the weights are still the initial ones.
        val_loss = trainer.evaluate([(inputs, targets)])
        step = trainer.train_step(0, inputs, targets)
        grads = {}
        for index, layer in zip(trainer.module.units, trainer.module.layers):
            for name, p in layer.named_parameters():
                grads[(index, name)] = p.grad.detach().numpy().copy()
        heavy = [name for name in ("torch._dynamo", "torch.distributed.pipelining", "sympy") if name in sys.modules]
        results.put((rank, step.loss, val_loss, grads, heavy))
    finally:
        dist.destroy_process_group()


def _reference(n_stages: int):
    """Loss (mean over micro-batches) and gradients of the whole model in this process."""
    cfg = _config(n_stages)
    model = GPT(cfg.model.shape, cfg.run.seed)
    inputs, targets = _batch()
    mb = cfg.inner.microbatches
    loss = torch.stack([lm_loss(model(x), y) for x, y in zip(inputs.chunk(mb), targets.chunk(mb))]).mean()
    loss.backward()
    grads = {
        (index, name): p.grad.numpy()
        for index, layer in enumerate(model.stage.layers)
        for name, p in layer.named_parameters()
    }
    return loss.item(), grads


@pytest.fixture(scope="module")
def warm():
    """The context the stage processes start from: forked from one server that imported this module (torch with it)"""
    with niced.warm_context(__name__) as ctx:
        yield ctx


def _run_ranks(ctx, function: str, world: int, *args) -> list:
    """`world` processes of `function(rank, port, results, *args)`, joined by a TCPStore on `port`; what each put in
    `results`, by rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    calls = [(__name__, function, r, store.port, results, *args) for r in range(world)]
    procs = [ctx.Process(target=niced.call, args=a) for a in calls]  # below the swarm tier's peers (helpers/niced.py)
    for p in procs:
        p.start()
    try:
        out = []
        for _ in procs:
            try:
                out.append(results.get(timeout=_TIMEOUT_S))
            except queue.Empty:
                codes = [p.exitcode for p in procs]
                raise AssertionError(f"a {function} sent nothing in {_TIMEOUT_S}s; exit codes {codes}") from None
        for p in procs:
            p.join(timeout=30)
        assert [p.exitcode for p in procs] == [0] * world
        return sorted(out, key=lambda item: item[0])
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _run_stages(ctx, n_stages: int, schedule: str = "1f1b", precision: str = "fp32") -> list:
    return _run_ranks(ctx, "_stage_process", n_stages, n_stages, schedule, precision)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n_stages, schedule", [(1, "1f1b"), (2, "1f1b"), (4, "1f1b"), (4, "gpipe")])
def test_pipeline_stages_reproduce_the_whole_models_loss_and_every_gradient(warm, n_stages, schedule):
    ref_loss, ref_grads = _reference(n_stages)
    results = _run_stages(warm, n_stages, schedule)

    losses = [loss for _, loss, _, _, _ in results]
    assert all(loss is None for loss in losses[:-1]), "only the last stage knows the loss"
    assert losses[-1] == pytest.approx(ref_loss, abs=1e-5)

    val_losses = [val for _, _, val, _, _ in results]
    assert all(val is None for val in val_losses[:-1])
    assert val_losses[-1] == pytest.approx(ref_loss, abs=1e-5)

    compared = []
    for _, _, _, grads, _ in results:
        for key, grad in grads.items():
            assert key in ref_grads, f"stage sent a gradient the reference lacks: {key}"
            np.testing.assert_allclose(grad, ref_grads[key], rtol=0, atol=1e-5, err_msg=str(key))
            compared.append(key)
    assert sorted(compared) == sorted(ref_grads), "every parameter is compared exactly once"
    # an eager stage imports none of them (1.6 s, and sympy 0.4 s, of one core at its start: pipeline_schedule.py)
    assert all(heavy == [] for *_, heavy in results), [heavy for *_, heavy in results]


@pytest.mark.timeout(180)
def test_bf16_stages_hand_each_other_bf16_activations_and_still_follow_the_whole_models_gradients(warm):
    # inner.precision=bf16 (a GPU's default, allowed on CPU): every boundary carries bf16 both ways, the last
    # stage included, and the loss and gradients stay those of the fp32 model up to bf16 rounding
    ref_loss, ref_grads = _reference(2)
    results = _run_stages(warm, 2, "1f1b", "bf16")

    assert results[-1][1] == pytest.approx(ref_loss, rel=2e-2)
    for _, _, _, grads, _ in results:
        for key, grad in grads.items():
            ref = ref_grads[key].ravel()
            cosine = float(np.dot(grad.ravel(), ref) / (np.linalg.norm(grad) * np.linalg.norm(ref) + 1e-30))
            assert np.isfinite(grad).all() and cosine > 0.98, (key, cosine)


def _replica_process(rank: int, port: int, results, replicas: int, n_stages: int) -> None:
    """Rank = replica * n_stages + stage: two steps of its replica's share of the batch, through its pipeline;
    sends back the losses, its averaged gradients of the first step and its weights after the second."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=replicas * n_stages)
    try:
        replica, stage = divmod(rank, n_stages)
        pipelines = [dist.new_group([r * n_stages + s for s in range(n_stages)]) for r in range(replicas)]
        copies = [dist.new_group([r * n_stages + s for r in range(replicas)]) for s in range(n_stages)]
        cfg = _config(n_stages)
        trainer = InnerTrainer(cfg, stage=stage, device=torch.device("cpu"), group=pipelines[replica],
                               replicas=replicas, replica_group=copies[stage])  # fmt: skip
        inputs, targets = _batch()
        share = slice(replica * BATCH // replicas, (replica + 1) * BATCH // replicas)
        losses = [trainer.train_step(0, inputs[share], targets[share]).loss]
        grads = {(i, n): p.grad.numpy().copy() for i, layer in zip(trainer.module.units, trainer.module.layers)
                 for n, p in layer.named_parameters()}  # fmt: skip
        losses.append(trainer.train_step(1, inputs[share], targets[share]).loss)
        weights = {(i, n): p.detach().numpy().copy() for i, layer in zip(trainer.module.units, trainer.module.layers)
                   for n, p in layer.named_parameters()}  # fmt: skip
        results.put((rank, losses, grads, weights))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_replicas_of_a_two_stage_pipeline_train_as_one_process_on_the_whole_batch(warm):
    # issue 36, DP x PP: 4 processes (2 replicas x 2 stages, gloo); each replica trains half of the batch and the
    # replicas average their gradients, so each step is the whole batch's, as one process training all of it
    replicas, n_stages = 2, 2
    reference = InnerTrainer(_config(1), stage=0, device=torch.device("cpu"))
    inputs, targets = _batch()
    ref_losses = [reference.train_step(0, inputs, targets).loss]
    ref_grads = {(i, n): p.grad.numpy().copy() for i, layer in zip(reference.module.units, reference.module.layers)
                 for n, p in layer.named_parameters()}  # fmt: skip
    ref_losses.append(reference.train_step(1, inputs, targets).loss)

    results = _run_ranks(warm, "_replica_process", replicas * n_stages, replicas, n_stages)

    by_rank = {rank: (losses, grads, weights) for rank, losses, grads, weights in results}
    for replica in range(replicas):
        last = by_rank[replica * n_stages + n_stages - 1][0]
        assert last == pytest.approx(ref_losses, abs=1e-5), "a step is not the whole batch's"
        assert by_rank[replica * n_stages][0] == [None, None], "only the last stage knows the loss"
    for rank, (_, grads, _) in by_rank.items():
        for key, grad in grads.items():
            np.testing.assert_allclose(grad, ref_grads[key], rtol=0, atol=1e-5, err_msg=f"rank {rank} {key}")
    for stage in range(n_stages):  # the replicas of a stage hold the same weights, bit for bit
        first, second = (by_rank[r * n_stages + stage][2] for r in range(replicas))
        assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)


def _simulated_bubble(order: str, n_stages: int, microbatches: int) -> float:
    """The idle share of each stage's step when every forward and backward takes one unit of time: the stages run
    their `stage_order` actions in order, each as soon as what it needs (the activation from the stage before,
    the gradient from the stage after) is done."""
    from dilocox_p2p.pipeline_schedule import stage_order

    pending = [list(stage_order(order, s, n_stages, microbatches)) for s in range(n_stages)]
    done: dict[tuple[str, int, int], int] = {}
    free = [0] * n_stages
    while any(pending):
        progressed = False
        for s in range(n_stages):
            if not pending[s]:
                continue
            kind, i = pending[s][0]
            needs = [("F", s - 1, i)] if kind == "F" and s else []
            if kind == "B":
                needs = [("F", s, i)] + ([("B", s + 1, i)] if s < n_stages - 1 else [])
            if all(n in done for n in needs):
                done[(kind, s, i)] = free[s] = max([free[s]] + [done[n] for n in needs]) + 1
                pending[s].pop(0)
                progressed = True
        assert progressed, "the schedule deadlocks"
    return 1 - 2 * microbatches / max(done.values())


@pytest.mark.parametrize("order", ["1f1b", "gpipe"])
def test_the_reported_bubble_is_the_idle_share_of_a_step_and_shrinks_with_more_microbatches(order):
    from dilocox_p2p.pipeline_schedule import bubble_fraction

    for n_stages in (2, 3, 4):
        for microbatches in range(n_stages, 9):
            assert bubble_fraction(n_stages, microbatches) == pytest.approx(_simulated_bubble(order, n_stages, microbatches))
    assert bubble_fraction(4, 16) < bubble_fraction(4, 4) and bubble_fraction(1, 4) == 0.0
