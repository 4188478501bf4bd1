"""A changed member record reaches the stage's other members by push, not by their next DHT poll.

    pytest tests/swarm/test_member_push.py -q

Real hivemind DHT nodes and averager processes on loopback (member_push.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from dilocox_p2p.swarm import membership as membership_module
from dilocox_p2p.swarm.averager import DilocoxAverager
from dilocox_p2p.swarm.dht import RunRecords
from dilocox_p2p.swarm.heartbeat import Heartbeat
from dilocox_p2p.swarm.faults import FaultCounter
from dilocox_p2p.swarm.membership import Membership
from dilocox_p2p.wire import swarm_pb2
from tests.helpers.signed import signed_node

pytestmark = pytest.mark.swarm

RUN = "push"
CONFIG = "0" * 64


class _Worker:
    """What a stage worker holds for its member record: DHT node, averager, records, heartbeat, membership."""

    def __init__(self, initial_peers=()):
        self.dht, signer, gate = signed_node(RUN, initial_peers=initial_peers)
        self.peer_id = self.dht.peer_id.to_base58()
        self.averager = DilocoxAverager(
            [torch.zeros(8)], self.dht, run_id=RUN, config_hash=CONFIG, stage=0, prefix="push_s0", start=True,
            min_group_size=2, min_matchmaking_time=5.0, request_timeout=2.5, allreduce_timeout=10.0,
            next_chunk_timeout=5.0, allow_state_sharing=False, signer=signer, gate=gate,
        )  # fmt: skip
        self.faults = FaultCounter()
        self.records = RunRecords(self.dht, RUN, 0, self.faults, signer=signer, gate=gate)
        record = swarm_pb2.MemberRecord(run_id=RUN, config_hash=CONFIG, stage=0, boundary=0, training=True,
                                        joined_at=time.time(), peer_name=self.peer_id[-6:])  # fmt: skip
        self.heartbeat = Heartbeat(self.records, record)
        self.membership = Membership(self.records, config_hash=CONFIG, faults=self.faults)
        self.membership.pushed = self.averager.pushed_records

    def close(self) -> None:  # its heartbeat beats only when updated: no thread to stop
        self.membership.close()
        self.averager.shutdown()
        self.dht.shutdown()


def _only_pushes(monkeypatch) -> None:
    """Members' views read the DHT once a minute at most: what they see sooner came by push."""
    for name in ("POLL_S", "LOOK_S", "REFRESH_S", "BARRIER_POLL_S"):
        monkeypatch.setattr(membership_module, name, 60.0)


@pytest.fixture
def pair():
    a = _Worker()
    b = _Worker(initial_peers=a.dht.get_visible_maddrs())
    yield a, b
    for worker in (a, b):
        worker.close()


def test_a_members_round_start_wakes_the_others_wait_at_once_though_their_dht_poll_is_a_minute(pair, monkeypatch):
    a, b = pair
    _only_pushes(monkeypatch)  # b's view: one DHT lookup as it starts, then only pushes
    a.heartbeat.on_change = lambda value, expiration: a.averager.push_member(value, expiration, [b.peer_id])
    a.heartbeat.update(averaging_round=0)  # a trains round 1: b waits for it to start that round's exchange
    b.membership.start()
    assert [m.record.averaging_round for m in b.membership.members()] == [0]
    found, looked = [], threading.Event()

    def wait() -> None:  # give_up is asked once the wait has looked and found a late
        found.extend(b.membership.wait_for_round(1, 30.0, give_up=lambda: looked.set() or False))

    waiting = threading.Thread(target=wait)
    started = time.monotonic()
    waiting.start()
    assert looked.wait(timeout=20.0)
    a.heartbeat.update(averaging_round=1)  # stored in the DHT, then pushed to b
    waiting.join(timeout=40.0)
    took = time.monotonic() - started
    assert [(m.peer_id, m.record.averaging_round) for m in found] == [(a.peer_id, 1)]
    assert took < 10.0, f"b saw a start the round after {took:.1f} s (its DHT poll: 60 s, its wait: 30 s)"
    assert b.faults.take()["requests_refused"] == 0


def _process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (a DHT node's process and its p2p daemon)."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [pid, *(p for child in children for p in _process_tree(child))]


def test_a_changed_record_reaches_the_others_at_once_while_its_store_waits_on_a_frozen_dht_node(pair, monkeypatch):
    # a third peer's machine freezes (SIGSTOP: swapped out, a preempted VM): its DHT node still takes connections
    # and answers nothing, and a store that meets it waits out hivemind's timeouts (6 s). The record of the round a
    # has started must reach b at once all the same: b waits for it to start that round's exchange
    a, b = pair
    _only_pushes(monkeypatch)
    frozen, _, _ = signed_node(RUN, initial_peers=a.dht.get_visible_maddrs())
    a.heartbeat.on_change = lambda value, expiration: a.averager.push_member(value, expiration, [b.peer_id])
    a.heartbeat.update(averaging_round=0)
    b.membership.start()
    assert [m.record.averaging_round for m in b.membership.members()] == [0]
    a.heartbeat.start()
    found, looked = [], threading.Event()

    def wait() -> None:
        found.extend(b.membership.wait_for_round(1, 30.0, give_up=lambda: looked.set() or False))

    waiting = threading.Thread(target=wait)
    waiting.start()
    pids = _process_tree(frozen.pid)
    try:
        assert looked.wait(timeout=20.0)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        a.heartbeat.update(averaging_round=1, wait=False)  # what a worker does as it starts a round's exchange
        waiting.join(timeout=40.0)
        took = time.monotonic() - started
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        a.heartbeat.stop(leave=False)
        frozen.shutdown()
    assert [(m.peer_id, m.record.averaging_round) for m in found] == [(a.peer_id, 1)]
    assert took < 3.0, f"b saw a start the round after {took:.1f} s (a store to the frozen node takes 6 s)"


def _record(averaging_round: int) -> swarm_pb2.MemberRecord:
    return swarm_pb2.MemberRecord(run_id=RUN, config_hash=CONFIG, stage=0, boundary=0, training=True,
                                  averaging_round=averaging_round, joined_at=time.time(), peer_name="a")  # fmt: skip


def test_a_pushed_record_signed_by_another_worker_is_refused_and_an_older_copy_never_replaces_a_newer(
    pair, monkeypatch
):
    a, b = pair
    _only_pushes(monkeypatch)
    older, expiration = a.records.publish_member(_record(3))
    a.records.publish_member(_record(4))  # the DHT holds round 4's record, signed after round 3's
    b_own, b_expiration = b.records.publish_member(_record(4))
    b.membership.start()
    assert {m.peer_id: m.record.averaging_round for m in b.membership.members()} == {a.peer_id: 4}
    a.averager.push_member(b_own, b_expiration, [b.peer_id])  # b's record, pushed by a: not a's to push
    a.averager.push_member(older, expiration, [b.peer_id])  # a's own older record, pushed again
    # b waits for a to start round 5 (it never does) and takes both pushes meanwhile
    waited = b.membership.wait_for_round(5, 3.0, give_up=lambda: False)
    assert [(m.peer_id, m.record.averaging_round) for m in waited] == [(a.peer_id, 4)]
    assert b.faults.take()["requests_refused"] == 1


def test_a_members_view_keeps_a_live_member_from_its_beats_pushes_alone_with_no_dht_read_after_the_first(
    pair, monkeypatch
):
    # every beat pushes the record (with a later expiration), so the view holds a live member past its record's
    # TTL without reading the DHT again; a record not renewed would drop out of it as it expires
    from dilocox_p2p.swarm import dht as dht_module
    from dilocox_p2p.swarm import heartbeat as heartbeat_module

    a, b = pair
    _only_pushes(monkeypatch)
    for module in (dht_module, heartbeat_module):
        monkeypatch.setattr(module, "MEMBER_TTL_S", 3.0)
    monkeypatch.setattr(heartbeat_module, "HEARTBEAT_S", 0.5)
    reads = []
    members = b.records.members
    monkeypatch.setattr(b.records, "members", lambda: reads.append(time.monotonic()) or members())
    a.heartbeat.on_change = lambda value, expiration: a.averager.push_member(value, expiration, [b.peer_id])
    b.membership.start()
    a.heartbeat.start()
    try:
        assert _eventually(lambda: [m.peer_id for m in b.membership.members()] == [a.peer_id], 10.0)
        seen = []
        until = time.monotonic() + 3 * 3.0  # three TTLs of a's record
        while time.monotonic() < until:
            seen.append(a.peer_id in {m.peer_id for m in b.membership.members()})
            time.sleep(0.1)
    finally:
        a.heartbeat.stop(leave=False)
    assert all(seen), f"a dropped out of b's view {seen.count(False)} times in {len(seen)} looks"
    assert len(reads) <= 2, f"b read the DHT {len(reads)} times"  # the first lookup, and (at most) one more


def _eventually(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_a_view_keeps_a_member_whose_record_expired_until_a_lookup_after_the_expiry_finds_it_gone(pair, monkeypatch):
    # a worker frozen past every record's expiration (SIGSTOP, a swapped-out VM) wakes up with the view it read
    # before: its members' records have all expired, yet nothing says they left; only a lookup made after that
    # does (churn soak in CI: a thawed worker found itself alone, trained two rounds alone and was repaired)
    from dilocox_p2p.swarm import dht as dht_module
    from dilocox_p2p.swarm import heartbeat as heartbeat_module

    a, b = pair
    for module in (dht_module, heartbeat_module):
        monkeypatch.setattr(module, "MEMBER_TTL_S", 2.0)
    a.heartbeat.update(averaging_round=0)  # a's record, stored once for 2 s: nothing renews it
    assert b.membership.refresh()  # b's one lookup; its view's threads never run, as in a frozen worker
    assert [m.peer_id for m in b.membership.members()] == [a.peer_id]
    expires = max(m.expiration for m in b.membership.members())
    time.sleep(max(0.0, expires - time.time()) + 0.5)
    assert [m.peer_id for m in b.membership.members()] == [a.peer_id], "a dropped out with no lookup since it expired"
    assert a.peer_id in b.membership.voters()
    assert b.membership.refresh()  # a lookup after the expiry: no node holds a record of a any more
    assert b.membership.members() == [] and a.peer_id not in b.membership.voters()


def test_an_average_record_pushed_to_a_voter_waits_for_its_rounds_vote_and_a_forged_or_stale_one_never_counts(pair):
    # phase 5 read the group's AverageRecords from the DHT every 0.2 s until the majority settled; now each voter's
    # record is pushed to the others as it is stored (vote.py), and a vote takes what was pushed for its round
    from dilocox_p2p.swarm.member_push import PushedAverages
    from dilocox_p2p.swarm.vote import _newest  # how a vote merges what each look brings

    a, b = pair

    def record(round: int, average_hash: str) -> swarm_pb2.AverageRecord:
        return swarm_pb2.AverageRecord(round=round, group_id=b"g", average_hash=average_hash, kind="averaged")

    a.averager.push_average(a.records.seal_average(record(1, "stale")), [b.peer_id])  # a round b has voted in
    a.averager.push_average(b.records.seal_average(record(3, "forged")), [b.peer_id])  # b's signature, a's push
    a.averager.push_average(a.records.seal_average(record(3, "first")), [b.peer_id])
    a.averager.push_average(a.records.seal_average(record(3, "adopted")), [b.peer_id])  # a took the majority's
    a.averager.push_average(a.records.seal_average(record(4, "next")), [b.peer_id])  # b has not voted in round 4
    pushes, got, refused = PushedAverages(b.averager.pushed_averages, b.records), {}, []

    def taken() -> bool:
        # the pushes travel as tasks of their own: "adopted" may come in an earlier look than "first", and the latest
        # signed wins across looks as the vote merges them (CI run 194: a plain update let "first" overwrite it)
        _newest(got, pushes.take(3, 0.5))
        refused.append(b.faults.take()["requests_refused"])
        return bool(got) and sum(refused) >= 1

    assert _eventually(taken, 20), (got, refused)
    time.sleep(1.0)  # every push has come
    assert taken() and set(got) == {a.peer_id} and got[a.peer_id].message.average_hash == "adopted", got
    assert sum(refused) == 1  # the forged one, refused as a record read from the DHT would be
    later = pushes.take(4, 0.5)
    assert {p: o.message.average_hash for p, o in later.items()} == {a.peer_id: "next"}
    assert pushes.take(1, 0.5) == {} and pushes.take(3, 0.5) == {}  # the stale one dropped; round 3's taken once
