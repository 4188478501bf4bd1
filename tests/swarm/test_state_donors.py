"""Joiners take the swarm's state in pieces from several donors at once (swarm/state_pieces.py).

Run: python -m pytest tests/swarm/test_state_donors.py -q
"""

from __future__ import annotations

import collections
import signal
import time

import pytest

from benchmarks.soak import worker_peer_id

pytestmark = pytest.mark.swarm


def _wait_for(condition, timeout, message):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message()
        time.sleep(0.2)


def test_four_joiners_at_once_take_the_state_in_pieces_from_every_donor_and_drop_the_one_that_lies(swarm):
    # Every joiner took its whole state from the same donor (the most advanced holder of the majority's hash), as in
    # hivemind#169. Four donors train, one of which serves every piece of its state altered and signed (it lies);
    # four joiners start at once. Each takes its state in pieces from the donors holding the majority's hash,
    # checks every piece against it, asks the liar for nothing more after its first piece, and holds the swarm's
    # theta_g from its first round; no donor serves more than half of the bytes the joiners took.
    args = ("--mode", "delayed", "--stages", "1", "--rounds", "60")
    honest = [swarm.start_peer(*args, "--min-peers", "4") for _ in range(3)]
    liar = swarm.start_peer(*args, "--min-peers", "4", env={"DILOCOX_FAULTS": "corrupt_served_piece:stage=0"})
    honest[0].wait_for_round(1, timeout=180)  # the run has moved on: the joiners cannot start at round 0
    joiners = [swarm.start_peer(*args) for _ in range(4)]
    _wait_for(lambda: all(len(j.metrics()) >= 2 for j in joiners), 300,
              lambda: "a joiner never trained two rounds:\n" + "\n".join(j.output()[-3000:] for j in joiners))
    everyone = [*honest, liar, *joiners]
    for peer in everyone:
        peer.signal(signal.SIGTERM)
    for peer in everyone:
        assert peer.wait(timeout=120) == 128 + signal.SIGTERM, peer.output()

    liar_id = worker_peer_id(liar.run_dir, 0)
    served: collections.Counter[str] = collections.Counter()
    for joiner in joiners:
        records = joiner.metrics()
        first = records[0]
        assert first["round"] >= 2 and first["faults"]["catch_ups"] >= 1, first  # it took the swarm's state
        taken = first["state_donors"][0]
        assert len(taken) >= 2, f"the state came whole from one donor: {taken}"
        for record in records:
            served.update(record["state_donors"][0])
        log = joiner.stage_log(0)
        assert f"donor {liar_id} asked for no more pieces: refused: piece" in log, log[-3000:]
        hashes = {r["round"]: r["stage_hashes"] for r in records}
        theirs = {r["round"]: r["stage_hashes"] for r in honest[0].metrics()}
        common = sorted(set(hashes) & set(theirs))
        assert common and all(hashes[t] == theirs[t] for t in common), f"a joiner differs from the swarm: {common}"
    assert liar_id not in served, "bytes of the lying donor were kept"
    total = sum(served.values())
    assert max(served.values()) <= total / 2, {d[-6:]: round(n / total, 2) for d, n in served.items()}


def test_a_donor_that_stalls_is_asked_for_nothing_more_and_its_pieces_come_from_the_others(swarm):
    # a donor whose link has all but stopped holds each request for a piece of its state 60 s: once the others'
    # pieces are in, the joiner asks the next donor for the stalled ones (SLOW_FACTOR) and takes the state without it
    args = ("--mode", "delayed", "--stages", "1", "--rounds", "60")
    honest = [swarm.start_peer(*args, "--min-peers", "3") for _ in range(2)]
    stalled = swarm.start_peer(*args, "--min-peers", "3", env={"DILOCOX_FAULTS": "stall_served_piece:stage=0"})
    honest[0].wait_for_round(1, timeout=180)
    joiner = swarm.start_peer(*args)
    _wait_for(lambda: len(joiner.metrics()) >= 2, 300, lambda: f"the joiner never trained two rounds:\n{joiner.output()}")
    everyone = [*honest, stalled, joiner]
    for peer in everyone:
        peer.signal(signal.SIGTERM)
    for peer in everyone:
        assert peer.wait(timeout=120) == 128 + signal.SIGTERM, peer.output()

    stalled_id = worker_peer_id(stalled.run_dir, 0)
    records = joiner.metrics()
    taken = records[0]["state_donors"][0]
    assert sorted(taken) == sorted(worker_peer_id(p.run_dir, 0) for p in honest), taken
    assert f"donor {stalled_id} asked for no more pieces: slow: piece" in joiner.stage_log(0)
    theirs = {r["round"]: r["stage_hashes"] for r in honest[0].metrics()}
    common = [r["round"] for r in records if r["round"] in theirs]
    assert common and all(r["stage_hashes"] == theirs[r["round"]] for r in records if r["round"] in theirs)
