"""The rule by which a round's group forms again without matchmaking (swarm/group_reuse.py)."""

from __future__ import annotations

import pytest
import torch
from hivemind.utils import MSGPackSerializer

from dilocox_p2p.average import Average, AverageKind
from dilocox_p2p.proto_gen import envelope_pb2
from dilocox_p2p.swarm.group_reuse import (
    RoundTicket, WholeGroup, gathered_round, reuse_group_id, reuse_order, reused_group, whole_group,
)
from dilocox_p2p.swarm.group_round import RoundResult
from dilocox_p2p.wire import swarm_pb2

pytestmark = pytest.mark.unit

MEMBERS = ("peer-a", "peer-b", "peer-c")


def _gathered(round: int) -> bytes:
    """A JoinRequest.gather as hivemind's step makes it: (bandwidth, mode, the sealed ticket), the ticket an envelope
    naming `round` (unsigned here: the rule reads the round only; the averager checks the signature)."""
    envelope = envelope_pb2.Envelope(round=round, payload=envelope_pb2.GroupTicket(schema=b"s").SerializeToString())
    sealed = envelope_pb2.SignedEnvelope(body=envelope.SerializeToString()).SerializeToString()
    return MSGPackSerializer.dumps([None, 0, MSGPackSerializer.dumps(sealed)])


def _records(round: int, members=MEMBERS[1:], **changes) -> dict[str, swarm_pb2.MemberRecord]:
    records = {p: swarm_pb2.MemberRecord(averaging_round=round, gathered=_gathered(round)) for p in members}
    for peer, fields in changes.items():
        for name, value in fields.items():
            setattr(records[peer], name, value)
    return records


def _ticket(round: int) -> RoundTicket:
    return RoundTicket(round, b"sealed", _gathered(round), ())


def _rule(round=5, last=WholeGroup(4, MEMBERS), mine="", records=None):
    return reused_group(run_id="run", stage=0, round=round, me="peer-a", mine=_ticket(round) if mine == "" else mine,
                        last=last, records=_records(round) if records is None else records)  # fmt: skip


def test_the_members_of_a_whole_group_that_all_started_the_next_round_with_a_ticket_form_it_again():
    group, why = _rule()
    assert why == "" and group is not None
    assert sorted(group.members) == list(MEMBERS) and len(group.gathered) == 3
    assert group.gathered[group.members.index("peer-b")] == _records(5)["peer-b"].gathered
    assert group.ticket == b"sealed"  # its step carries the ticket its record holds


def test_every_member_builds_the_same_group_id_and_order_whoever_it_is():
    one, _ = _rule()
    other, _ = reused_group(run_id="run", stage=0, round=5, me="peer-c", mine=_ticket(5), last=WholeGroup(4, MEMBERS),
                            records=_records(5, ("peer-a", "peer-b")))  # fmt: skip
    assert (one.group_id, one.members) == (other.group_id, other.members)
    assert one.gathered == other.gathered  # the same tickets, the same bandwidths: the same ranks and load balance


def test_the_order_rotates_with_the_round_and_the_id_names_run_stage_round_and_members():
    assert [reuse_order(MEMBERS, r)[0] for r in range(4)] == ["peer-a", "peer-b", "peer-c", "peer-a"]
    ids = {reuse_group_id("run", 0, 5, MEMBERS), reuse_group_id("run", 0, 6, MEMBERS), reuse_group_id("run", 1, 5, MEMBERS),
           reuse_group_id("other", 0, 5, MEMBERS), reuse_group_id("run", 0, 5, MEMBERS[:2])}  # fmt: skip
    assert len(ids) == 5 and all(len(i) == 20 for i in ids)
    assert reuse_group_id("run", 0, 5, MEMBERS) == reuse_group_id("run", 0, 5, MEMBERS[::-1])


@pytest.mark.parametrize("case, kwargs, reason", [
    ("no whole round", dict(last=None), "did not average whole"),
    ("a round older than the last", dict(last=WholeGroup(3, MEMBERS)), "did not average whole"),
    ("no ticket of its own", dict(mine=None), "made no ticket"),
    ("its ticket of another round", dict(mine=_ticket(4)), "made no ticket"),
    ("a member more", dict(records=_records(5, ("peer-b", "peer-c", "peer-d"))), "not the last round's group"),
    ("a member less", dict(records=_records(5, ("peer-b",))), "not the last round's group"),
    ("a member still in the round before", dict(records=_records(5, **{"peer-c": {"averaging_round": 4}})), "not started"),
    ("a member sitting the round out", dict(records=_records(5, **{"peer-c": {"sitting_out": 6}})), "sits it out"),
    ("a client member", dict(records=_records(5, **{"peer-b": {"client": True}})), "client member"),
    ("a ticket of another round", dict(records=_records(5, **{"peer-b": {"gathered": _gathered(4)}})), "no ticket of this round"),
    ("no ticket", dict(records=_records(5, **{"peer-b": {"gathered": b""}})), "no ticket of this round"),
    ("garbage for a ticket", dict(records=_records(5, **{"peer-b": {"gathered": b"\x00junk"}})), "no ticket of this round"),
])  # fmt: skip
def test_anything_short_of_the_whole_group_with_its_tickets_falls_back_to_matchmaking(case, kwargs, reason):
    group, why = _rule(**kwargs)
    assert group is None and reason in why, case


def _average(kind=AverageKind.AVERAGED, group=MEMBERS, **fields):
    return Average(kind=kind, tensors=[torch.zeros(4)], group=tuple(group), **fields)


def _result(**fields):
    return RoundResult(round=4, group=list(MEMBERS), group_id=b"g", missing=(), **fields)


def test_a_round_is_whole_only_when_averaged_by_every_member_with_nothing_refused_or_missing():
    assert whole_group(4, _average(), _result()) == WholeGroup(4, tuple(sorted(MEMBERS)))
    assert whole_group(4, _average(), None) is None
    for kind in (AverageKind.MENDED, AverageKind.PARTIAL, AverageKind.BORROWED):
        assert whole_group(4, _average(kind), _result()) is None, kind
    assert whole_group(4, _average(missing=((0, 2),)), _result()) is None
    assert whole_group(4, _average(off_majority=True), _result()) is None
    for fields in ({"failed_reducers": ["peer-b"]}, {"outsiders": ["peer-c"]}, {"offenders": {"peer-b": "nan"}},
                   {"banned_senders": ["peer-b"]}, {"clients": ["peer-c"]}):  # fmt: skip
        assert whole_group(4, _average(), _result(**fields)) is None, fields
    assert whole_group(4, _average(group=MEMBERS[:2]), _result()) is None  # the average applied is another group's
    assert whole_group(4, _average(group=MEMBERS[:1]), RoundResult(round=4, group=["peer-a"], group_id=b"g", missing=())) is None


def test_the_round_a_gathered_ticket_names_is_read_and_anything_else_is_none():
    assert gathered_round(_gathered(7)) == 7
    assert gathered_round(b"") is None and gathered_round(MSGPackSerializer.dumps([1, 2])) is None
