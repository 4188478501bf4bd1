"""A client member (swarm.reachability = client, what a peer behind NAT becomes by itself) averages in every
round, reduces nothing and leads no group; the group holds one state (swarm/client_member.py).

    pytest tests/swarm/test_client_member.py -q

Real peers on loopback, one stage; the NAT itself is in tests/netns/test_volunteers_behind_nat.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.peers import accounts

pytestmark = pytest.mark.swarm

ROUNDS = 5


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_client_member_averages_every_round_reducing_nothing_and_its_group_agrees(swarm, compression):
    args = ("--stages", "1", "--inner-steps", "5", "--mode", "sync", "--rounds", str(ROUNDS), "--min-peers", "3",
            "--compression", compression)  # fmt: skip
    full = [swarm.start_peer(*args, "--reachability", "public") for _ in range(2)]
    client = swarm.start_peer(*args, "--reachability", "client")
    peers = [*full, client]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()

    records = [{r["round"]: r for r in peer.metrics()} for peer in peers]
    assert all(sorted(r) == list(range(ROUNDS)) for r in records), [sorted(r) for r in records]
    for t in range(ROUNDS):
        assert len({tuple(r[t]["stage_hashes"]) for r in records}) == 1, accounts(peers, t)
    # it is said so, and its own contribution is in every average: its rounds end averaged in a group of three
    assert all(r["clients"] == ["swarm.reachability = client"] for r in records[2].values())
    assert all(r["clients"] == [""] for r in records[0].values())
    kinds = [(t, r["kinds"], r["group_sizes"]) for t, r in sorted(records[2].items())]
    assert all(k == ["averaged"] and g == [3] for _, k, g in kinds[1:]), kinds  # round 0: a busy start may split it
    # it reduced nothing: it sent its message once (its parts, one per reducer), where each of the two reducers also
    # served its reduced part to the two others; and it never led (nobody asked it to: no refused join request)
    for t in range(1, ROUNDS):
        ratio = records[2][t]["bytes_sent"] / records[0][t]["bytes_sent"]
        assert ratio < 0.8, f"round {t}: the client member sent {ratio:.2f}x a reducer's bytes"
    assert "averages as a client member" not in client.stage_log(0)  # forced by the flag, not found unreachable
