"""A round whose averaging step never ends does not hang its peer (exchange._step_overdue), in a real swarm.

    pytest tests/swarm/test_lost_step.py -q
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.swarm

ROUNDS = 5
LOST = 2  # the round whose step the faulty member never sees end
ALLREDUCE_TIMEOUT = 10.0  # the step's deadline once grouped; the member gives up on it STEP_GRACE_S later


def test_a_step_whose_end_never_comes_is_given_up_past_its_deadlines_and_the_group_average_taken(swarm):
    # hivemind's step reports its end through an MPFuture; once, under load, that report was lost (an InvalidStateError
    # in its thread) and the exchange thread waited for it forever: the peer hung. Here one member's step of round
    # LOST says it runs its all-reduce and never ends (fault injection `lose_step`). The member gives up on it past
    # the all-reduce deadline, cancels it, takes the average the others computed without it, and trains on: every
    # peer ends the run, and all three hold one theta_g after every round, having sent each other no flood of DHT
    # requests while they waited for it (matchmaking.space_queue_reads).
    args = ("--mode", "sync", "--stages", "1", "--rounds", str(ROUNDS), "--min-peers", "3", "--compression", "int8",
            "--set", f"swarm.allreduce_timeout={ALLREDUCE_TIMEOUT}")  # fmt: skip
    others = [swarm.start_peer(*args) for _ in range(2)]
    stuck = swarm.start_peer(*args, env={"DILOCOX_FAULTS": f"lose_step:round={LOST}:stage=0"})
    for peer in [*others, stuck]:
        assert peer.wait(timeout=300) == 0, peer.output()

    log = stuck.stage_log(0)
    lost = [int(m) for m in re.findall(r"round (\d+): hivemind's averaging step had not ended", log)]
    assert lost == [LOST], log[-3000:]
    mine = {r["applied_round"]: r for r in stuck.metrics() if r["applied_round"] is not None}
    assert mine[LOST]["kinds"] == ["borrowed"], mine[LOST]["kinds"]  # the others' average, computed without it
    assert sum(r["faults"]["steps_lost"] for r in mine.values()) == 1
    seconds = mine[LOST]["allreduce_windows"][0][1] - mine[LOST]["allreduce_windows"][0][0]
    assert seconds < 3 * ALLREDUCE_TIMEOUT, seconds  # given up past the deadline plus its grace, not later
    for peer in others:
        rounds = {r["applied_round"]: r for r in peer.metrics() if r["applied_round"] is not None}
        assert set(rounds) == set(mine) == set(range(ROUNDS))
        assert all(rounds[t]["stage_hashes"] == mine[t]["stage_hashes"] for t in rounds), "the members disagree"
    # the others waited in matchmaking for it in the round after: hivemind's search re-read its empty leader queue in
    # a tight loop, over 100 DHT finds a second to each other node (refused past their limit); now 1 in QUEUE_READ_S
    for peer in [*others, stuck]:
        refused = [line for line in peer.stage_log(0).splitlines() if "refused a DHT find" in line]
        assert not refused, refused[:3]
