"""An inner step that does not fit the memory stops with advice, also when the optimizer allocates its state.

The forward and backward case runs a whole peer (tests/swarm/test_lone_peer.py). Here a child process
trains one step of the `small` preset, then limits its data segment (RLIMIT_DATA) to what it holds
plus a margin that a second forward and backward fit in and AdamW's two moments per parameter do not:
a real allocation failure, in the optimizer's first step.

    pytest tests/unit/test_inner_memory.py -q
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import resource

import pytest
import torch

from dilocox_p2p.config import load_config
from dilocox_p2p.errors import StageOutOfMemory
from dilocox_p2p.inner import InnerTrainer

pytestmark = pytest.mark.unit

MARGIN = 48 * 2**20  # room for a micro-batch's activations and torch's small allocations; AdamW needs 8 B/parameter


def _data_bytes() -> int:
    with open("/proc/self/status") as status:
        kb = next(int(line.split()[1]) for line in status if line.startswith("VmData:"))
    return kb * 1024


def _child(results: mp.Queue) -> None:
    torch.set_num_threads(1)
    overrides = {"model.preset": "small", "model.stages": 1, "model.seq_len": 16, "inner.batch_size": 1,
                 "inner.microbatches": 1}  # fmt: skip
    trainer = InnerTrainer(load_config(overrides=overrides), stage=0, device=torch.device("cpu"))
    inputs = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    trainer._run_schedule(inputs, inputs, train=True)  # the gradients exist, the optimizer state does not
    state_bytes = 8 * trainer.n_params()
    assert state_bytes > 2 * MARGIN
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_data_bytes() + MARGIN, hard))
    try:
        trainer.train_step(0, inputs, inputs)
        outcome = ("trained", "")
    except StageOutOfMemory as e:
        outcome = ("refused", str(e))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        outcome = ("other", repr(e))
    finally:  # the queue's thread needs memory too
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))
    results.put(outcome)


def test_an_optimizer_state_too_big_for_the_memory_names_more_stages_not_micro_batches():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_child, args=(results,))
    child.start()
    try:
        for _ in range(600):  # 120 s, or until the child died without an answer
            try:
                outcome, message = results.get(timeout=0.2)
                break
            except queue.Empty:
                if not child.is_alive():
                    pytest.fail(f"the child died without an answer (exit code {child.exitcode})")
        else:
            pytest.fail("the child gave no answer within 120 s")
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert outcome == "refused", (outcome, message)
    assert "ran out of cpu memory in the inner optimizer step" in message, message
    assert "AdamW keeps two fp32 moments per parameter" in message and "--stages" in message
    assert "more micro-batches do not help" in message
