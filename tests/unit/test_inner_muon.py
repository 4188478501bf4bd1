"""inner.optimizer = muon: Muon on the transformer blocks' weight matrices, AdamW on everything else, with
torch.optim.Muon's update (its Newton-Schulz iterations in fp32 off CUDA), checkpoints that resume to the same bits,
the step counts and moments a replica copies, and a clear refusal of the other optimizer's checkpoint.

    pytest tests/unit/test_inner_muon.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch

from dilocox_p2p.config import ConfigError, load_config
from dilocox_p2p.inner import InnerTrainer
from dilocox_p2p.inner_optimizer import InnerMuon
from dilocox_p2p.model import Block, Embedding, Head

pytestmark = pytest.mark.unit


def _trainer(optimizer: str = "muon") -> InnerTrainer:
    cfg = load_config(overrides={"model.preset": "tiny", "model.stages": 1, "inner.batch_size": 4,
                                 "inner.microbatches": 1, "inner.warmup_steps": 0, "inner.optimizer": optimizer})  # fmt: skip
    return InnerTrainer(cfg, stage=0, device=torch.device("cpu"))


def _batches(trainer: InnerTrainer, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (4, trainer.cfg.model.shape.seq_len + 1), generator=g) for _ in range(n)]


def _train(trainer: InnerTrainer, batches: list[torch.Tensor], first: int = 0) -> list[float]:
    return [trainer.train_step(first + i, b[:, :-1], b[:, 1:]).loss for i, b in enumerate(batches)]


def _same(a: InnerTrainer, b: InnerTrainer) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.params, b.params))


def test_muon_trains_every_blocks_matrices_and_adamw_the_embeddings_head_biases_and_norms():
    trainer = _trainer()
    optimizer = trainer.optimizer
    assert isinstance(optimizer, InnerMuon)
    blocks = [m for m in trainer.module.modules() if isinstance(m, Block)]
    assert {id(p) for p in optimizer.matrices} == {id(l.weight) for b in blocks for l in (b.qkv, b.proj, b.fc, b.out)}
    adamw = [p for group in optimizer.adamw.param_groups for p in group["params"]]
    kept_out = [p for m in trainer.module.modules() if isinstance(m, (Embedding, Head)) for p in m.parameters()]
    assert {id(p) for p in kept_out} <= {id(p) for p in adamw}
    # every parameter in exactly one of the two
    assert sorted(id(p) for p in [*adamw, *optimizer.matrices]) == sorted(id(p) for p in trainer.module.parameters())
    losses = _train(trainer, _batches(trainer, 1) * 8)  # one batch again and again: it learns it by heart
    assert losses[-1] < 0.9 * losses[0], losses


def test_muons_step_is_torch_optim_muons_to_its_bf16_rounding():
    # torch computes the Newton-Schulz iterations in bf16; on a CPU this optimizer computes them in fp32
    torch.manual_seed(0)
    start = [torch.randn(48, 16) * 0.1, torch.randn(16, 64) * 0.1]
    ours = [torch.nn.Parameter(m.clone()) for m in start]
    theirs = [torch.nn.Parameter(m.clone()) for m in start]
    bias = torch.nn.Parameter(torch.zeros(3))
    mine = InnerMuon(ours, [{"params": [bias], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                     momentum=0.95)  # fmt: skip
    torchs = torch.optim.Muon(theirs, lr=1e-2, weight_decay=0.1, momentum=0.95, nesterov=True,
                              adjust_lr_fn="match_rms_adamw")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        mine.step()
        torchs.step()
    for p, q, p0 in zip(ours, theirs, start):
        moved, expected = p.detach() - p0, q.detach() - p0
        assert float((moved - expected).norm() / expected.norm()) < 0.03


def test_a_muon_checkpoint_resumes_on_the_same_trajectory_bit_for_bit():
    reference = _trainer()
    batches = _batches(reference, 6)
    _train(reference, batches)
    first = _trainer()
    _train(first, batches[:3])
    saved = copy.deepcopy({"model": first.module.state_dict(), "inner": first.state_dict()})
    resumed = _trainer()
    resumed.module.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["inner"])
    _train(resumed, batches[3:], first=3)
    assert _same(resumed, reference)


def test_a_copy_made_from_the_step_counts_and_moments_a_replica_sends_trains_as_the_original():
    original, copy_ = _trainer(), _trainer()
    batches = _batches(original, 4)
    assert original.optimizer.steps_taken() is None  # no state before the first step: nothing to send
    _train(original, batches[:2])
    steps = original.optimizer.steps_taken()
    assert steps is not None and len(steps) == len(list(original.module.parameters()))
    copy_.optimizer.set_steps_taken(steps)  # as replicas.py: the counts, then every moment in place
    with torch.no_grad():
        for mine, theirs in zip([*copy_.params, *copy_.optimizer.moments()],
                                [*original.params, *original.optimizer.moments()]):  # fmt: skip
            mine.copy_(theirs)
    _train(original, batches[2:], first=2)
    _train(copy_, batches[2:], first=2)
    assert _same(copy_, original)


@pytest.mark.parametrize("saved, resumed", [("adamw", "muon"), ("muon", "adamw")])
def test_a_checkpoint_of_the_other_inner_optimizer_is_refused_with_the_setting_that_reads_it(saved, resumed):
    writer = _trainer(saved)
    _train(writer, _batches(writer, 1))
    with pytest.raises(ValueError, match=f"inner.optimizer = {saved}'s, this stage runs {resumed}: resume with "
                                         f"--set inner.optimizer={saved}"):  # fmt: skip
        _trainer(resumed).load_state_dict(writer.state_dict())


def test_an_unknown_inner_optimizer_or_a_momentum_of_one_is_refused():
    with pytest.raises(ConfigError, match="inner.optimizer = 'sgd': must be one of: adamw, muon"):
        load_config(overrides={"inner.optimizer": "sgd"})
    with pytest.raises(ConfigError, match=r"inner.muon_momentum = 1.0: must be in \[0, 1\)"):
        load_config(overrides={"inner.muon_momentum": 1.0})
