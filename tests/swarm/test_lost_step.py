"""A round whose averaging step never ends does not hang its peer (exchange._step_overdue), in a real swarm.

    pytest tests/swarm/test_lost_step.py -q
"""

from __future__ import annotations

import re

import pytest

from dilocox_p2p.swarm.exchange import STEP_GRACE_S, STEP_LOOK_EXTRA_S

pytestmark = pytest.mark.swarm

ROUNDS = 4
LOST = 2  # the round whose step the faulty member never sees end
ALLREDUCE_TIMEOUT = 10.0
ROUND_WAIT = 5.0
# the member gives up on the step STEP_GRACE_S past its search's deadline and one all-reduce's (exchange._step_overdue)
GIVEN_UP_S = ROUND_WAIT + STEP_LOOK_EXTRA_S + ALLREDUCE_TIMEOUT + STEP_GRACE_S


def test_a_step_whose_end_never_comes_is_given_up_past_its_deadlines_and_the_group_average_taken(swarm):
    # hivemind's step reports its end through an MPFuture; once, under load, that report was lost (an InvalidStateError
    # in its thread) and the exchange thread waited for it forever: the peer hung. Here one member's step of round
    # LOST says it runs its all-reduce and never ends (fault injection `lose_step`). The member gives up on it past
    # its search's and all-reduce's deadlines, cancels it, takes the average the others computed without it, and trains on: every
    # peer ends the run, and all three hold one theta_g at every boundary, having sent each other no flood of DHT
    # requests while they waited for it (matchmaking.space_queue_reads).
    args = ("--mode", "sync", "--stages", "1", "--rounds", str(ROUNDS), "--min-peers", "3", "--compression", "int8",
            "--set", f"swarm.allreduce_timeout={ALLREDUCE_TIMEOUT}", "--round-wait", str(ROUND_WAIT))  # fmt: skip
    others = [swarm.start_peer(*args) for _ in range(2)]
    stuck = swarm.start_peer(*args, env={"DILOCOX_FAULTS": f"lose_step:round={LOST}:stage=0"})
    for peer in [*others, stuck]:
        assert peer.wait(timeout=300) == 0, peer.output()

    log = stuck.stage_log(0)
    lost = [int(m) for m in re.findall(r"round (\d+): hivemind's averaging step had not ended", log)]
    assert lost == [LOST], log[-3000:]
    records = stuck.metrics()
    hit = [r for r in records if r["faults"]["steps_lost"]]
    assert len(hit) == 1 and hit[0]["applied_round"] == LOST, [(r["round"], r["applied_round"]) for r in records]
    assert hit[0]["kinds"] == ["borrowed"], hit[0]["kinds"]  # the others' average, computed without it
    seconds = hit[0]["allreduce_windows"][0][1] - hit[0]["allreduce_windows"][0][0]
    assert GIVEN_UP_S < seconds < GIVEN_UP_S + 10, seconds  # given up past the deadlines plus the grace, not later
    # the others trained on meanwhile (it may then have taken their state at a later boundary): one theta_g at every
    # boundary it recorded, and at the last
    mine = {r["round"]: r["stage_hashes"] for r in records}
    assert max(mine) == ROUNDS - 1
    for peer in others:
        theirs = {r["round"]: r["stage_hashes"] for r in peer.metrics()}
        assert set(theirs) == set(range(ROUNDS))
        assert all(theirs[t] == mine[t] for t in mine), "the members disagree"
    # the others waited in matchmaking for it in the round after: hivemind's search re-read its empty leader queue in
    # a tight loop, over 100 DHT finds a second to each other node (refused past their limit); now 1 in QUEUE_READ_S
    for peer in [*others, stuck]:
        refused = [line for line in peer.stage_log(0).splitlines() if "refused a DHT find" in line]
        assert not refused, refused[:3]
