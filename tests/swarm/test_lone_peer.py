"""A lone peer (the first of a new swarm) trains, learns, and resumes exactly after a crash.

    pytest tests/swarm/test_lone_peer.py -q
"""

from __future__ import annotations

import json
import resource
import signal

import pytest

from tests.helpers.peers import Peer

pytestmark = pytest.mark.swarm

DATA_LIMIT = 3 * 2**29  # 1.5 GiB: a tiny peer's stage trains within it at 4 sequences per micro-batch


def test_a_lone_peer_with_two_stages_lowers_val_loss_by_30_percent(tmp_path):
    # 12 rounds: 0.675 of the initial val loss at round 9, 0.586 at round 12 (2026-11-30). Without a swarm: what it
    # checks is the pipeline's training (a peer alone in a swarm applies its own pseudo-gradient alike: test_elastic)
    peer = Peer(tmp_path / "lone", ["--rounds", "12", "--inner-steps", "10", "--data-seed", "0", "--no-swarm"])
    assert peer.wait(timeout=240) == 0, peer.output()
    initial = json.loads((peer.run_dir / "run.json").read_text())["initial_val_loss"]
    final = peer.metrics()[-1]["val_loss"]
    assert len(peer.metrics()) == 12
    assert final <= 0.7 * initial, f"val loss {initial:.3f} -> {final:.3f}"


def test_a_peer_trained_in_bf16_ends_within_one_percent_of_fp32_at_equal_tokens(tmp_path):
    # bf16 autocast touches the inner forward and backward only (fp32 weights, AdamW state and outer step), and
    # the two stages hand each other bf16 activations; both runs side by side, on the same data
    # 7 rounds: fp32 is at 0.70 of its initial loss, and bf16 within 0.02% of it at every round (10 rounds: 0.60)
    args = ["--rounds", "7", "--inner-steps", "10", "--data-seed", "0", "--no-swarm"]
    peers = {p: Peer(tmp_path / p, [*args, "--set", f"inner.precision={p}"]) for p in ("fp32", "bf16")}
    for peer in peers.values():
        assert peer.wait(timeout=240) == 0, peer.output()
    assert "inner: bf16 on cpu" in peers["bf16"].stage_log(0)
    fp32, bf16 = (peers[p].metrics() for p in ("fp32", "bf16"))
    assert [r["tokens"] for r in bf16] == [r["tokens"] for r in fp32] and len(fp32) == 7
    initial = json.loads((peers["fp32"].run_dir / "run.json").read_text())["initial_val_loss"]
    assert fp32[-1]["val_loss"] < 0.8 * initial, "fp32 did not learn: nothing to compare"
    gap = bf16[-1]["val_loss"] / fp32[-1]["val_loss"] - 1
    assert abs(gap) <= 0.01, f"bf16 val loss {bf16[-1]['val_loss']:.4f} vs fp32 {fp32[-1]['val_loss']:.4f}"


def test_a_step_too_big_for_the_memory_stops_the_peer_with_the_settings_that_shrink_it(tmp_path):
    # a real allocation failure: the stages may map at most DATA_LIMIT bytes, and one micro-batch of 1024
    # sequences needs more (16 micro-batches of 64 train within it); the peer must say which settings make the
    # step fit, not print a traceback
    args = ["--no-swarm", "--stages", "1", "--rounds", "1", "--inner-steps", "2", "--set", "data.val_batches=1",
            "--set", "inner.batch_size=1024", "--set", "inner.microbatches=1"]  # fmt: skip
    peer = Peer(tmp_path / "big", args, limits={resource.RLIMIT_DATA: DATA_LIMIT})
    assert peer.wait(timeout=120) == 2, peer.output()
    error = peer.stage_log(0)
    assert "stage 0 ran out of cpu memory in a forward or backward pass" in error, error[-3000:]
    for setting in ("--microbatches, now 1", "inner.checkpoint_activations=true", "--stages", "--batch-size"):
        assert setting in error
    assert "Traceback" not in peer.output()


@pytest.mark.parametrize(
    "mode",
    [(), ("--mode", "streaming", "--fragments", "2", "--overlap-steps", "2", "--stages", "1"),
     ("--replicas", "2", "--stages", "1", "--set", "inner.optimizer=muon")],
    ids=["delayed", "streaming", "replicas-muon"],
)
def test_a_run_killed_mid_round_and_resumed_ends_bit_identical_to_an_uninterrupted_one(tmp_path, mode):
    # streaming: the checkpoint also keeps the weights this peer trains from (they differ from theta_g); delayed
    # checks a pipeline of 2 stages, streaming one stage (what it checks does not depend on the stages);
    # replicas-muon: 2 copies of the pipeline, whose second copy (no checkpoint of its own) takes the resumed state,
    # the data's position and the inner optimizer's state from the first (replicas.py); of one stage (DP x PP:
    # test_replicas.py). inner.optimizer = muon: Muon's momentum for the blocks' matrices and AdamW's moments for the
    # rest, so one run covers both optimizers' state (AdamW alone, as a separate replicas case, added 13 s and no path)
    # the power cut comes after inner step 3 of round 3 (of its second sync, streaming), decided by no timing
    args = ["--rounds", "4", "--inner-steps", "10", "--seed", "3", "--data-seed", "5", *mode]
    syncs = 2 if "streaming" in mode else 1
    auto = ["--resume", "auto"] if "streaming" in mode else []  # streaming also checks `--resume auto`: starts afresh, then resumes
    reference = Peer(tmp_path / "reference", [*args, *auto])
    crashed = Peer(tmp_path / "crashed", args, env={"DILOCOX_FAULTS": "kill_peer_mid_round:round=3:step=3:stage=0"})
    assert crashed.wait(timeout=180) == -signal.SIGKILL, crashed.output()
    assert "fault injection: killing the peer (round 3, after inner step 3)" in crashed.output() + crashed.stage_log(0)
    assert [r["round"] for r in crashed.metrics()] == [0, 1, 2], "not killed in round 3"

    resumed = Peer(tmp_path / "crashed", [*args, *(auto or ["--resume"])])
    assert resumed.wait(timeout=180) == 0, resumed.output()
    assert reference.wait(timeout=180) == 0, reference.output()
    want, got = reference.metrics(), resumed.metrics()
    assert [r["round"] for r in got] == list(range(4 * syncs))  # rounds after the checkpoint were trained again
    assert got[-1]["stage_hashes"] == want[-1]["stage_hashes"]
    assert [r["stage_hashes"] for r in got] == [r["stage_hashes"] for r in want]


def test_a_peer_with_middle_stages_and_no_swarm_trains_and_evaluates(tmp_path):
    # stages 1 and 2 read no data: they must still run the schedule for every batch
    peer = Peer(tmp_path / "four", ["--stages", "4", "--rounds", "2", "--inner-steps", "5", "--no-swarm",
                                        "--set", "inner.microbatches=4"])
    assert peer.wait(timeout=180) == 0, peer.output()
    records = peer.metrics()
    assert [r["round"] for r in records] == [0, 1]
    assert len(records[-1]["stage_hashes"]) == 4
    assert records[-1]["val_loss"] < json.loads((peer.run_dir / "run.json").read_text())["initial_val_loss"]
    assert not (peer.run_dir / "multiaddrs.txt").exists()  # no DHT was started
