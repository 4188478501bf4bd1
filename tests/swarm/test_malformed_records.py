"""A record whose fields this software cannot use is refused where it is read, never raised where it is used.

Real hivemind DHT nodes on loopback, each with its own signed worker key: the records are signed and pass the
envelope checks; only their contents are malformed (an admitted member that sends them, issue 38 point 7).

    pytest tests/swarm/test_malformed_records.py -q
"""

from __future__ import annotations

import pytest

from dilocox_p2p.average import AverageKind
from dilocox_p2p.swarm.dht import RunRecords
from dilocox_p2p.swarm.faults import FaultCounter
from dilocox_p2p.wire import swarm_pb2
from tests.helpers.signed import signed_node

pytestmark = pytest.mark.swarm


def _average_record(kind: str, missing: list[tuple[int, int]] = ()) -> swarm_pb2.AverageRecord:
    return swarm_pb2.AverageRecord(round=3, group_id=b"g", average_hash="ab" * 32, kind=kind,
                                   missing=[swarm_pb2.Span(start=a, end=b) for a, b in missing])  # fmt: skip


def test_average_records_with_an_unknown_kind_or_crossed_spans_are_refused_and_counted_the_others_read(tmp_path):
    nodes = [signed_node("mr", root=tmp_path)]
    nodes += [signed_node("mr", root=tmp_path, initial_peers=nodes[0][0].get_visible_maddrs()) for _ in range(2)]
    faults = FaultCounter()
    honest, bogus, crossed = (RunRecords(dht, "mr", 0, faults, signer=signer, gate=gate) for dht, signer, gate in nodes)
    try:
        honest.publish_average(_average_record("mended", [(0, 5), (9, 12)]))
        bogus.publish_average(_average_record("exact"))  # no AverageKind: AverageKind("exact") raised ValueError
        crossed.publish_average(_average_record("partial", [(9, 12), (0, 5)]))

        found = honest.average_records(3)

        assert list(found) == [honest.peer_id]
        assert AverageKind(found[honest.peer_id].kind) is AverageKind.MENDED
        assert faults.take()["records_refused"] == 2
    finally:
        for dht, _, _ in nodes:
            dht.shutdown()


def test_a_member_record_that_claims_to_have_joined_before_this_software_ran_or_after_it_signed_is_refused(tmp_path):
    # joined_at = -1e300 was taken, and the oldest member decides the config check (issue 38, point 3)
    import time

    nodes = [signed_node("mr", root=tmp_path)]
    nodes += [signed_node("mr", root=tmp_path, initial_peers=nodes[0][0].get_visible_maddrs()) for _ in range(2)]
    faults = FaultCounter()
    honest, ancient, future = (RunRecords(dht, "mr", 0, faults, signer=signer, gate=gate) for dht, signer, gate in nodes)

    def record(joined_at: float) -> swarm_pb2.MemberRecord:
        return swarm_pb2.MemberRecord(run_id="mr", stage=0, training=True, joined_at=joined_at, peer_name="m")

    try:
        honest.publish_member(record(time.time()))
        ancient.publish_member(record(-1e300))
        future.publish_member(record(time.time() + 3600))

        assert [m.peer_id for m in honest.members()] == [honest.peer_id]
        assert faults.take()["records_refused"] == 2
    finally:
        for dht, _, _ in nodes:
            dht.shutdown()
