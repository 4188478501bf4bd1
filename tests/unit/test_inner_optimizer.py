"""The inner optimizer makes torch.optim.AdamW's updates, bit for bit, reads and writes its checkpoints, and
keeps torch._dynamo out of an eager stage of one stage (a second of CPU at every start).

    pytest tests/unit/test_inner_optimizer.py -q
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dilocox_p2p.inner_optimizer import InnerAdamW
from tests.helpers.artifacts import ROOT

pytestmark = pytest.mark.unit


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def _groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def _train(model: torch.nn.Module, optimizer, steps: range) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    for step in steps:
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 / (step + 1)  # a schedule sets the lr between steps
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _torch_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(_groups(model), lr=1e-2, betas=(0.9, 0.95), foreach=True)


def _inner_adamw(model: torch.nn.Module) -> InnerAdamW:
    return InnerAdamW(_groups(model), lr=1e-2, betas=(0.9, 0.95))


def test_the_inner_optimizer_makes_torch_adamws_updates_bit_for_bit():
    ours, theirs = _model(), _model()
    _train(ours, _inner_adamw(ours), range(6))
    _train(theirs, _torch_adamw(theirs), range(6))
    assert _same(ours, theirs)


@pytest.mark.parametrize("writer", ["torch", "ours"])
def test_a_checkpoint_of_either_optimizer_resumes_in_the_other_on_the_same_trajectory(writer):
    reference = _model()
    _train(reference, _torch_adamw(reference), range(6))
    make_writer, make_reader = (_torch_adamw, _inner_adamw) if writer == "torch" else (_inner_adamw, _torch_adamw)
    first = _model()
    optimizer = make_writer(first)
    _train(first, optimizer, range(3))
    saved = copy.deepcopy({"model": first.state_dict(), "optimizer": optimizer.state_dict()})
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    optimizer = make_reader(resumed)
    optimizer.load_state_dict(saved["optimizer"])
    _train(resumed, optimizer, range(3, 6))
    assert _same(resumed, reference)


def test_a_checkpoint_of_other_parameter_groups_is_refused_with_what_differs():
    model = _model()
    optimizer = _inner_adamw(model)
    _train(model, optimizer, range(1))
    state = optimizer.state_dict()
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:1]
    with pytest.raises(ValueError, match="parameter groups of \\[1, 4\\] tensors, this stage \\[2, 4\\]"):
        _inner_adamw(_model()).load_state_dict(state)


def test_an_eager_stage_of_one_stage_trains_without_importing_torch_dynamo():
    code = textwrap.dedent("""
        import sys, torch
        from dilocox_p2p.config import load_config
        from dilocox_p2p.inner import InnerTrainer
        cfg = load_config(overrides={"model.preset": "tiny", "model.stages": 1, "inner.batch_size": 2,
                                     "inner.microbatches": 1, "inner.compile": "auto"})
        trainer = InnerTrainer(cfg, stage=0, device=torch.device("cpu"))
        batch = torch.randint(0, 256, (2, cfg.model.shape.seq_len), generator=torch.Generator().manual_seed(0))
        trainer.train_step(0, batch, batch)
        trainer.load_state_dict(trainer.state_dict())
        trainer.train_step(1, batch, batch)
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"], out.stdout


def test_a_stage_compiled_whole_trains_as_the_eager_one():
    """inner.compile_scope = stage (the default): the stage module compiles as one graph, for real (dynamo captured
    it), and trains to the eager stage's losses, to compiled kernels' rounding. (Scope `unit` compiles each unit.)"""
    scope = "stage"
    # compilation runs g++ for half a minute: in one process, niced below the swarm tier's peers (helpers/niced.py),
    # so that the swarm tests beside it in CI (timed exchanges) keep their cores
    code = textwrap.dedent(f"""
        import json, os
        os.nice(19 - os.nice(0))
        import torch
        from torch._dynamo.utils import counters
        from dilocox_p2p.config import load_config
        from dilocox_p2p.inner import InnerTrainer
        torch.set_num_threads(1)
        losses = {{}}
        for compiled in ("off", "on"):
            cfg = load_config(overrides={{"model.preset": "tiny", "model.stages": 1, "inner.batch_size": 2,
                                          "inner.microbatches": 1, "inner.warmup_steps": 0, "inner.compile": compiled,
                                          "inner.compile_scope": "{scope}"}})
            trainer = InnerTrainer(cfg, stage=0, device=torch.device("cpu"))
            batch = torch.randint(0, 256, (2, cfg.model.shape.seq_len), generator=torch.Generator().manual_seed(0))
            losses[compiled] = [trainer.train_step(i, batch, batch).loss for i in range(3)]
        print(json.dumps({{"losses": losses, "graphs": counters["stats"]["unique_graphs"],
                          "whole": trainer.module._compiled_call_impl is not None}}))
    """)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["graphs"] >= 1
    assert result["whole"] == (scope == "stage")
    assert result["losses"]["on"] == pytest.approx(result["losses"]["off"], rel=1e-4)
    assert result["losses"]["on"][2] < result["losses"]["on"][0]
