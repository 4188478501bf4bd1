"""Peers on a real hivemind DHT average each stage's pseudo-gradients and stay identical.

    pytest tests/swarm/test_averaging.py -q

3 real peers x 2 stages (12+ processes) on loopback, tiny model, CPU.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.swarm

ROUNDS = 5


def _by_round(peers):
    rounds: dict[int, list[dict]] = {}
    for peer in peers:
        for record in peer.metrics():
            rounds.setdefault(record["round"], []).append(record)
    return rounds


@pytest.mark.parametrize("mode", ["delayed", "sync"])
def test_three_peers_hold_identical_theta_g_every_round_and_learn(swarm, mode):
    args = ("--mode", mode, "--rounds", str(ROUNDS), "--min-peers", "3")
    peers = [swarm.start_peer(*args) for _ in range(3)]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()

    rounds = _by_round(peers)
    assert sorted(rounds) == list(range(ROUNDS))
    for t, records in rounds.items():
        assert len(records) == 3, f"round {t}: {len(records)} records"
        hashes = {tuple(r["stage_hashes"]) for r in records}
        assert len(hashes) == 1, f"round {t}: theta_g differs across peers: {hashes}"
    # every average that was applied came from the full group of three, on both stages
    applied = [r for records in rounds.values() for r in records if r["applied_round"] is not None]
    assert applied and all(r["group_sizes"] == [3, 3] for r in applied)
    assert all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in applied)
    expected_applied = {"delayed": lambda t: t - 1 if t else None, "sync": lambda t: t}[mode]
    # the last round of a run also applies what is still pending
    for t, records in rounds.items():
        want = t if t == ROUNDS - 1 else expected_applied(t)
        assert {r["applied_round"] for r in records} == {want}
    initial = json.loads((peers[0].run_dir / "run.json").read_text())["initial_val_loss"]
    assert rounds[ROUNDS - 1][0]["val_loss"] < initial - 0.3


def test_delayed_all_reduce_runs_while_the_next_round_trains(swarm):
    peers = [swarm.start_peer("--mode", "delayed", "--rounds", "4", "--min-peers", "3") for _ in range(3)]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()
    overlapped = 0
    for peer in peers:
        records = {r["round"]: r for r in peer.metrics()}
        for t in range(1, 3):
            # round t applies the all-reduce of round t-1, launched when round t-1's compute ended
            for stage in range(2):
                ar_start, ar_end = records[t]["allreduce_windows"][stage]
                prev_end = records[t - 1]["compute_windows"][stage][1]
                compute_start, compute_end = records[t]["compute_windows"][stage]
                assert ar_start >= prev_end  # launched after round t-1's inner steps
                if ar_start < compute_end and ar_end > compute_start:
                    overlapped += 1  # the exchange and round t's inner steps ran at the same time
    assert overlapped > 0
