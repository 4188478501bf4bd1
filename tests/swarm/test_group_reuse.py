"""A round's group formed again without matchmaking (swarm/group_reuse.py), in a real swarm.

    pytest tests/swarm/test_group_reuse.py -q
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from dilocox_p2p.identity import peer_id_of, worker_identity
from tests.helpers.waits import wait_for

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


def _identities_with_the_last_smallest(root: Path, count: int) -> None:
    """Worker keys for peers 0..count-1 of a swarm (where Swarm.start_peer's peers look for them), the last one's peer
    id the smallest: it leads the groups it is in (exchange._leader, the smallest peer id that started the round)."""
    ids = [peer_id_of(worker_identity(root / f"peer{i}" / "identity" / "stage0.ed25519")) for i in range(count - 1)]
    path = root / f"peer{count - 1}" / "identity" / "stage0.ed25519"
    while peer_id_of(worker_identity(path)) > min(ids):
        path.unlink()


@pytest.mark.parametrize("found_at", ["mending", "vote"])
def test_a_member_whose_reused_group_lost_its_partner_to_a_joiners_group_borrows_that_groups_average(swarm, found_at):
    # A pair forms its group again every round; a third peer joins. One of the pair reads the joiner's record in time
    # and looks for the round's group through matchmaking: the joiner leads it (the smallest peer id), and it follows.
    # The other had not read the record (fault injection: overlook_joiner) and forms the pair's group again. Its
    # parts wait at its partner until the joiner's group begins there (hivemind waits for a group to register), about
    # when its own timeouts end; whichever comes first, the partner is an outsider (BAD_GROUP_ID: the reuser looks
    # again, finds nobody and borrows) or a failed reducer: its all-reduce ends with its own pseudo-gradient on its own
    # span, and, asked for the rest, the partner answers with the joiner's group's average. Its group held nobody
    # else: it borrows that average too. Applied, its own split the swarm until the next hash check (CI, test_elastic).
    # Where the partner answers that it is an outsider while the reuser's round's wait lasts, the reuser looks again
    # and may find the joiner's group still open: all three average, nothing splits (CI run 237). In the round it
    # overlooked the joiner, the reuser is armed not to look again (fault injection skip_regroup), as one that learns
    # it after its wait was up; in other rounds it looks again as usual (where the pair's views of each other's
    # tickets differed and one of them reused alone, the pair found each other and averaged, and the round after
    # could still split: armed in every round, it borrowed there instead and nothing split later).
    # "vote": the reuser does not mend (fault injection skip_mending, as one whose partner's copy was not ready yet):
    # in phase 5 its partner announced a copy of another group, and it takes that one (vote.GroupVote._elsewhere).
    _identities_with_the_last_smallest(swarm.root, 3)
    args = ("--mode", "sync", "--stages", "1", "--rounds", "60", "--min-peers", "2")
    follower = swarm.start_peer(*args)
    faults = "overlook_joiner:stage=0;skip_regroup:stage=0" + (";skip_mending:stage=0" if found_at == "vote" else "")
    reuser = swarm.start_peer(*args, env={"DILOCOX_FAULTS": faults})
    follower.wait_for_round(2, timeout=180)  # round 1's group was round 0's, formed again
    joiner = swarm.start_peer(*args)
    wait_for(lambda: any(r["group_sizes"] == [3] for r in joiner.metrics()), 240,
              lambda: f"the joiner never averaged with the pair:\n{joiner.output()}")  # fmt: skip
    for peer in (follower, reuser, joiner):
        peer.signal(signal.SIGTERM)
    for peer in (follower, reuser, joiner):
        assert peer.wait(timeout=120) == 128 + signal.SIGTERM, peer.output()

    rounds = [{r["applied_round"]: r for r in p.metrics() if r["applied_round"] is not None} for p in (follower, reuser, joiner)]
    for t in sorted(set(rounds[0]) & set(rounds[1])):
        assert rounds[0][t]["stage_hashes"] == rounds[1][t]["stage_hashes"], f"round {t}: the pair disagree"
    for t in sorted(set(rounds[0]) & set(rounds[2])):
        assert rounds[0][t]["stage_hashes"] == rounds[2][t]["stage_hashes"], f"round {t}: the joiner differs"
    # the round the pair split: the follower and the joiner averaged as a pair, once (the reuser's last group is not
    # whole afterwards). The reuser formed its old group again there as the fault made it, or as it does unaided when
    # it had not read the joiner's record in time (seen: the fault never fired, the split came all the same)
    split = [t for t, r in rounds[2].items() if r["kinds"] == ["averaged"] and r["group_size"] == 2]
    assert len(split) == 1, [(t, r["kinds"], r["group_sizes"]) for t, r in sorted(rounds[2].items())]
    t = split[0]
    fired = [int(m) for m in re.findall(r"fault injection: overlook_joiner \(round=(\d+)", reuser.stage_log(0))]
    assert all(f <= t for f in fired), (fired, t)
    assert rounds[1][t]["kinds"] == ["borrowed"], rounds[1][t]["kinds"]
    assert rounds[0][t]["kinds"] == ["averaged"] and rounds[0][t]["group_size"] == 2
    assert rounds[1][t]["groups"] == rounds[0][t]["groups"] == rounds[2][t]["groups"], \
        "the reuser took another group's average than the others'"  # fmt: skip
