"""One peer key, one member of a stage: one group slot and one vote, however many workers it certifies, and a ban
reaches every worker of the banned worker's key (issue 38, point 2). Real hivemind DHT nodes on loopback, each
worker with its own signed worker key; three of them certified by one peer key.

    pytest tests/swarm/test_one_key_one_vote.py -q
"""

from __future__ import annotations

import time

import pytest

from dilocox_p2p.swarm.dht import RunRecords
from dilocox_p2p.swarm.faults import FaultCounter
from dilocox_p2p.swarm.membership import Membership
from dilocox_p2p.wire import swarm_pb2
from tests.helpers.signed import signed_node

pytestmark = pytest.mark.swarm

RUN, CONFIG = "okov", "0" * 64


def _record(joined_at: float) -> swarm_pb2.MemberRecord:
    return swarm_pb2.MemberRecord(run_id=RUN, config_hash=CONFIG, stage=0, training=True, joined_at=joined_at,
                                  peer_name="m")  # fmt: skip


def test_the_workers_of_one_peer_key_count_as_one_member_and_a_ban_reaches_all_of_them(tmp_path):
    shared_key = tmp_path / "sybil"
    shared_key.mkdir()
    first = signed_node(RUN, root=tmp_path)  # an honest peer: this test's reader
    nodes = [first, signed_node(RUN, root=tmp_path, initial_peers=first[0].get_visible_maddrs())]  # another honest one
    nodes += [signed_node(RUN, root=tmp_path, peer_home=shared_key, initial_peers=first[0].get_visible_maddrs())
              for _ in range(3)]  # fmt: skip
    faults = FaultCounter()
    records = [RunRecords(dht, RUN, 0, faults, signer=signer, gate=gate) for dht, signer, gate in nodes]
    me, honest, sybils = records[0], records[1], records[2:]
    membership = Membership(me, config_hash=CONFIG, faults=faults)
    try:
        now = time.time()
        for i, r in enumerate(records):
            r.publish_member(_record(now - 10 + i))  # the sybils joined last, the newest at the end
        assert membership.refresh()

        newest = sybils[-1].peer_id
        assert sorted(m.peer_id for m in membership.members(others_only=False)) == sorted([me.peer_id, honest.peer_id,
                                                                                          newest])  # fmt: skip
        assert membership.voters() == {me.peer_id, honest.peer_id, newest}

        key = me.key_of(newest)  # banned after strikes (stage._ban): its key with it
        me.gate.ban([newest], [key])
        membership.ban([newest], [key])
        assert membership.refresh()
        assert sorted(m.peer_id for m in membership.members(others_only=False)) == sorted([me.peer_id, honest.peer_id])
        assert membership.voters() == {me.peer_id, honest.peer_id}
        assert faults.take()["records_refused"] >= 2  # the key's other workers' records, refused by the gate
    finally:
        membership.close()
        for dht, _, _ in nodes:
            dht.shutdown()
