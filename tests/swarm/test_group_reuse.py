"""A round's group formed again without matchmaking (swarm/group_reuse.py), in a real swarm.

    pytest tests/swarm/test_group_reuse.py -q
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.swarm

ROUNDS = 6
LOOKS = range(2, 5)  # rounds in which one member looks for its group through matchmaking (fault injection)


@pytest.mark.parametrize("compression", [(), ("--compression", "int8"), ("--compression", "lowrank")],
                         ids=["fp32", "int8", "lowrank"])  # fmt: skip
def test_a_whole_group_forms_again_without_matchmaking_and_a_member_that_looked_for_it_joins_it_late(swarm, compression):
    # After a round that averaged whole, its members form the next round's group themselves from the tickets in their
    # member records: no join request, no DHT declaration. One member here looks through matchmaking in rounds 2-4 where
    # it could have reused the group (as one that had not read a record in time would): the others' first part (fp32)
    # or message request (int8) of the reused group reaches it while it looks, and it joins their group late. Every
    # round averages whole with all three, and the three hold one theta_g after every round. Low-rank: the group's
    # ranks come from the tickets in the records (the reused group's gathered data), alike at every member.
    args = ("--mode", "sync", "--stages", "1", "--rounds", str(ROUNDS), "--min-peers", "3", *compression)
    others = [swarm.start_peer(*args) for _ in range(2)]
    looking = swarm.start_peer(*args, env={"DILOCOX_FAULTS": ";".join(f"skip_group_reuse:round={r}:stage=0" for r in LOOKS)})
    for peer in [*others, looking]:
        assert peer.wait(timeout=300) == 0, peer.output()

    rounds = [{r["applied_round"]: r for r in p.metrics() if r["applied_round"] is not None} for p in (*others, looking)]
    for t in range(ROUNDS):
        assert len({tuple(r[t]["stage_hashes"]) for r in rounds}) == 1, f"round {t}: the members disagree"
    for r in rounds[:2]:  # (round 0 may split on 2 busy cores: then round 1 is found by matchmaking)
        reused = [t for t in range(1, ROUNDS) if r[t]["groups_reused"] == [True]]
        assert len(reused) >= ROUNDS - 2, [(t, r[t]["groups_reused"], r[t]["kinds"]) for t in sorted(r)]
        assert all(r[t]["kinds"] == ["averaged"] and r[t]["group_size"] == 3 for t in reused)
    log = looking.stage_log(0)
    # the fault fires only where the member could have formed the group without matchmaking
    hit = sorted(int(m) for m in re.findall(r"fault injection: skip_group_reuse \(round=(\d+)", log))
    assert hit and set(hit) <= set(LOOKS), hit
    assert log.count("late: the others of the last round's group formed it again without matchmaking") >= len(hit), log[-3000:]
    mine = rounds[2]
    for t in hit:
        assert mine[t]["groups_reused"] == [False]  # it looked: the group was not its own to form
        groups = {r[t]["groups"][0] for r in rounds}
        assert len(groups) == 1, f"round {t}: not one group ({groups})"
        assert all(r[t]["kinds"] == ["averaged"] and r[t]["group_size"] == 3 for r in rounds), \
            [(r[t]["kinds"], r[t]["group_sizes"]) for r in rounds]  # fmt: skip
