"""A DHT node that lost its routes to the swarm finds its way back (dilocox_p2p/swarm/reconnect.py).

    pytest tests/swarm/test_reconnect.py -q

Real hivemind DHT nodes on loopback. The routes are lost the way hivemind loses them when a call
goes unanswered (a stopped process, an outage): removed from the routing table on both sides.
The whole path, a SIGSTOPped peer, is tests/swarm/test_elastic.py's frozen peer.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import hivemind
import pytest
from hivemind.utils import get_dht_time

from dilocox_p2p.endpoints import free_ports
from dilocox_p2p.errors import SwarmError
from dilocox_p2p.identity import peer_id_of, worker_identity
from dilocox_p2p.swarm.dht_join import TRY_S, join_any
from dilocox_p2p.swarm.faults import FaultCounter
from dilocox_p2p.swarm.reconnect import RouteKeeper, join_lead

pytestmark = pytest.mark.swarm


async def _routes(_dht, node) -> list[str]:
    return sorted(peer.to_base58() for peer in node.protocol.routing_table.peer_id_to_uid)


async def _drop_routes(_dht, node) -> None:
    table = node.protocol.routing_table
    for node_id in list(table.uid_to_peer_id):
        del table[node_id]


def _maddr(dht: hivemind.DHT) -> str:
    return str(next(m for m in dht.get_visible_maddrs() if "127.0.0.1" in str(m)))


@pytest.fixture
def two_nodes():
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[_maddr(first)])
    yield first, second
    second.shutdown()
    first.shutdown()


def test_a_node_that_lost_every_route_pings_its_initial_peer_and_reads_the_swarms_records_again(two_nodes):
    first, second = two_nodes
    assert second.run_coroutine(_routes) == [first.peer_id.to_base58()]
    for dht in two_nodes:
        dht.run_coroutine(_drop_routes)
    assert first.store("k", "from the first", get_dht_time() + 60)  # stored on the first node alone now
    assert second.get("k", latest=True) is None, "the second node still reached the first"

    faults = FaultCounter()
    keeper = RouteKeeper(second, initial_peers=[_maddr(first)], members=dict, faults=faults)
    assert keeper.look() == [first.peer_id.to_base58()]
    assert second.run_coroutine(_routes) == [first.peer_id.to_base58()]
    assert first.run_coroutine(_routes) == [second.peer_id.to_base58()], "the first node did not take the caller back"
    assert second.get("k", latest=True).value == "from the first"
    assert keeper.look() == [], "a peer already in the routing table was asked again"


def test_a_node_without_initial_peers_asks_the_members_it_saw_and_counts_the_loss_once(two_nodes):
    first, second = two_nodes
    for dht in two_nodes:
        dht.run_coroutine(_drop_routes)
    faults = FaultCounter()
    member = second.peer_id.to_base58()  # the first node started the swarm: it knows the other only as a member
    seen = {member: True}  # a training member
    keeper = RouteKeeper(first, initial_peers=[], members=lambda: seen, faults=faults)
    assert keeper.look() == [member]
    assert first.run_coroutine(_routes) == [member]

    # lost again, and the member crashed meanwhile: counted once while it stays lost, not at every look
    for dht in two_nodes:
        dht.run_coroutine(_drop_routes)
    second.shutdown()
    seen = {}
    assert keeper.look() == [] and keeper.look() == []
    assert faults.take()["routes_lost"] == 1


def test_a_member_that_left_the_run_cleanly_is_not_asked_again_and_being_left_alone_is_no_lost_route(two_nodes):
    first, second = two_nodes
    member = second.peer_id.to_base58()
    seen = {member: True}
    faults = FaultCounter()
    keeper = RouteKeeper(first, initial_peers=[], members=lambda: seen, faults=faults)
    assert keeper.look() == []  # in the routing table: nothing to ask
    seen = {member: False}  # its last record: it no longer trains (dht.Heartbeat.stop(leave=True))
    keeper.look()
    second.shutdown()
    first.run_coroutine(_drop_routes)
    seen = {}
    assert keeper.look() == [] and faults.take()["routes_lost"] == 0


def test_a_keeper_whose_dht_process_was_killed_mid_look_closes_at_once(two_nodes):
    # A stop signalled to the whole process group kills the DHT process first; a look then waiting on a ping
    # (here to a stopped peer, which never answers) was left waiting out its whole timeout, and so was the exit
    first, second = two_nodes
    for dht in two_nodes:
        dht.run_coroutine(_drop_routes)
    address = _maddr(second)
    os.kill(second.pid, signal.SIGSTOP)
    try:
        keeper = RouteKeeper(first, initial_peers=[address], members=dict, faults=FaultCounter(), period=0.05)
        keeper.start()
        time.sleep(1.0)  # a look is in flight: its ping waits for the stopped peer
        os.kill(first.pid, signal.SIGKILL)
        first.join(timeout=10)
        started = time.monotonic()
        keeper.close()
        assert time.monotonic() - started < 2.0, "closing waited for a DHT process that was gone"
        assert not keeper._thread.is_alive()
    finally:
        os.kill(second.pid, signal.SIGCONT)


def test_a_stage_started_beside_its_stage_0_joins_it_the_moment_it_listens_and_reads_its_records(tmp_path):
    # stage 0's address is known before it starts, as launch._known_lead fixes it: its port and its key
    key = tmp_path / "stage0.ed25519"
    lead_maddr = f"/ip4/127.0.0.1/tcp/{free_ports('127.0.0.1')}/p2p/{peer_id_of(worker_identity(key))}"
    stage1 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    lead = hivemind.DHT(start=False, host_maddrs=[lead_maddr.split("/p2p/")[0]], identity_path=str(key),
                        check_if_identity_free=False)  # fmt: skip
    try:
        joining = threading.Thread(target=join_lead, args=(stage1, [lead_maddr]))
        joining.start()  # before stage 0 listens: it waits, then pings until stage 0's node answers
        time.sleep(0.5)
        assert joining.is_alive(), "joined a stage 0 that was not started"
        lead.run_in_background(await_ready=True)
        joining.join(timeout=60)
        assert not joining.is_alive()
        assert stage1.run_coroutine(_routes) == [lead.peer_id.to_base58()]
        assert lead.run_coroutine(_routes) == [stage1.peer_id.to_base58()], "stage 0 did not take the caller in"
        assert lead.store("k", "from stage 0", get_dht_time() + 60)
        assert stage1.get("k", latest=True).value == "from stage 0"
    finally:
        stage1.shutdown()
        lead.shutdown()


def test_a_join_begun_in_time_waits_for_a_slow_answer_past_the_wait_for_a_listener():
    # a restart beside busy peers: the initial peer's daemon listens at once, its DHT process answers late
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    joiner = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    address = _maddr(first)  # asked of its DHT process: before it stops
    os.kill(first.pid, signal.SIGSTOP)  # its p2p daemon (another process) still accepts and relays the ping
    thaw = threading.Timer(2.5, os.kill, (first.pid, signal.SIGCONT))
    try:
        started = time.monotonic()  # before the thaw's timer starts: the answer cannot come sooner than 2.5 s after
        thaw.start()
        answered = join_any(joiner, [address], timeout=1.0)
        took = time.monotonic() - started
        assert answered == [first.peer_id.to_base58()], "the answer that came after the wait was cut off"
        assert 2.5 <= took < 1.0 + TRY_S, took
        assert joiner.run_coroutine(_routes) == [first.peer_id.to_base58()]
    finally:
        thaw.cancel()
        os.kill(first.pid, signal.SIGCONT)
        joiner.shutdown()
        first.shutdown()


def test_a_stage_whose_stage_0_never_answers_says_where_it_looked_and_where_to_read_why():
    stage1 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nobody = f"/ip4/127.0.0.1/tcp/{free_ports('127.0.0.1')}/p2p/{stage1.peer_id.to_base58()}"  # nothing listens
    try:
        started = time.monotonic()
        with pytest.raises(SwarmError, match=r"stage 0 DHT node \(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+\) did not answer "
                                             r"within 1 s; see its log \(RUN_DIR/logs/stage0\.log\)"):
            join_lead(stage1, [nobody], timeout=1.0)
        assert time.monotonic() - started < 10
    finally:
        stage1.shutdown()
