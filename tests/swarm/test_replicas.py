"""Data parallelism inside a peer (`--replicas D`, DP x PP: replicas.py): D copies of the pipeline train one
peer's batch together, and the swarm sees the peer as it sees any other: one member per stage.

    pytest tests/swarm/test_replicas.py -q
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.peers import Peer

pytestmark = pytest.mark.swarm

ROUNDS = 3


def test_a_peer_of_two_replicas_trains_as_a_peer_of_one_on_the_same_batches(tmp_path):
    # 2 replicas x 2 stages: 4 stage processes over gloo, each replica training half of every step's batch; beside
    # it, the same peer with one replica, on the same data: the same losses, round by round, to float rounding.
    # Streaming: its merge of a fragment mid-round changes replica 0's weights, which its copies must follow (left
    # out, the losses differ by 1e-2 at the second round)
    args = ["--no-swarm", "--rounds", str(ROUNDS), "--data-seed", "0", "--mode", "streaming", "--inner-steps", "10"]
    one, two = Peer(tmp_path / "one", args), Peer(tmp_path / "two", [*args, "--replicas", "2"])
    for peer in (one, two):
        assert peer.wait(timeout=240) == 0, peer.output()
    a, b = one.metrics(), two.metrics()
    assert len(b) == len(a) >= ROUNDS and [r["tokens"] for r in b] == [r["tokens"] for r in a]
    for x, y in zip(a, b):
        assert y["train_loss"] == pytest.approx(x["train_loss"], abs=1e-5), (x["round"], x["train_loss"], y["train_loss"])
        assert y["val_loss"] == pytest.approx(x["val_loss"], abs=1e-5), (x["round"], x["val_loss"], y["val_loss"])
    assert b[-1]["val_loss"] < a[0]["val_loss"] - 0.2  # and it learns
    for stage in (0, 1):  # the copies in replica 1 trained beside replica 0's stages, and left when it ended the run
        log = (two.run_dir / "logs" / f"stage{stage}.replica1.log").read_text()
        assert f"replica 1 of 2: follows replica 0's stage {stage}" in log, log


def test_a_peer_of_two_replicas_joins_a_swarm_as_one_member_per_stage_and_agrees(swarm):
    wide = swarm.start_peer("--replicas", "2", "--rounds", str(ROUNDS), "--min-peers", "2")
    plain = swarm.start_peer("--rounds", str(ROUNDS), "--min-peers", "2")
    for peer in (wide, plain):
        assert peer.wait(timeout=240) == 0, peer.output()
    records = {p: {r["round"]: r for r in p.metrics()} for p in (wide, plain)}
    assert sorted(records[wide]) == sorted(records[plain]) == list(range(ROUNDS))
    for t in range(ROUNDS):
        assert records[wide][t]["stage_hashes"] == records[plain][t]["stage_hashes"], t
    # each stage's group: this peer's replica 0 and the other peer, never a copy of replica 1 (groups of 2, not 3)
    sizes = [r["group_sizes"] for p in (wide, plain) for r in records[p].values() if r["applied_round"] is not None]
    assert sizes and all(s == [2, 2] for s in sizes), sizes


def test_a_stop_signal_ends_every_process_of_every_replica(tmp_path):
    peer = Peer(tmp_path / "two", ["--no-swarm", "--rounds", "200", "--data-seed", "0", "--replicas", "2"])
    peer.wait_for_round(1, timeout=120)
    peer.signal(signal.SIGTERM)
    assert peer.wait(timeout=60) == 128 + signal.SIGTERM, peer.output()
    assert "continue with --resume" in peer.output()
    deadline = time.monotonic() + 30  # the peer's session (helpers/peers.py) empties: no copy of replica 1 is left
    while _session_alive(peer.proc.pid):
        assert time.monotonic() < deadline, "a process of the stopped peer is still running"
        time.sleep(0.2)


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
