"""swarm/wire_meter.py: a p2p daemon's bytes, read from the kernel's tcp_info, kept across sockets that close.

    pytest tests/unit/test_wire_meter.py -q
"""

from __future__ import annotations

import os
import socket

import pytest

from dilocox_p2p.swarm.wire_meter import Socket, WireMeter, fd_inodes, read_sockets

pytestmark = pytest.mark.unit


def test_a_real_connections_bytes_are_read_from_the_kernel_and_matched_to_its_process_by_inode():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        client.sendall(b"x" * 100_000)
        got = 0
        while got < 100_000:
            got += len(accepted.recv(65536))
        accepted.sendall(b"y" * 3000)
        client.recv(3000, socket.MSG_WAITALL)
        found = read_sockets()
        ends = {os.fstat(client.fileno()).st_ino: "client", os.fstat(accepted.fileno()).st_ino: "accepted"}
        held = fd_inodes(os.getpid())
    finally:
        for s in (client, accepted, server):
            s.close()
    assert found is not None
    counters = {ends[s.inode]: (s.sent, s.received) for s in found if s.inode in ends}
    assert counters == {"client": (100_000, 3000), "accepted": (3000, 100_000)}
    assert set(ends) <= held


def test_a_daemon_counts_its_own_sockets_but_not_inherited_ones_nor_those_to_its_peers_other_stages():
    sockets = [
        Socket(1, "10.0.0.1:4001", "10.0.0.2:4001", 100, 10),  # to another peer
        Socket(2, "10.0.0.1:5000", "10.0.0.2:5000", 10**6, 10**6),  # a pipeline socket its parent passed on
        Socket(3, "127.0.0.1:4001", "127.0.0.1:4002", 50, 50),  # to this peer's stage 1 (daemon 8)
        Socket(4, "127.0.0.1:4002", "127.0.0.1:4001", 50, 50),  # stage 1's end
    ]
    holds = {7: {1, 2, 3}, 6: {2}, 8: {4}}.get
    meter = WireMeter(lambda: 7, own=lambda: {7, 8}, read=lambda: sockets, holds=lambda p: holds(p, set()),
                      parent=lambda p: 6)  # fmt: skip
    assert meter.take() == ((100, 10), (0, 0))
    other_peer = WireMeter(lambda: 7, own=lambda: {7}, read=lambda: sockets, holds=lambda p: holds(p, set()),
                           parent=lambda p: 6)  # daemon 8 is another peer's: the loopback connection counts
    assert other_peer.take() == ((150, 60), (0, 0))


def test_a_socket_that_closed_keeps_what_it_had_moved_and_nothing_is_made_up_when_the_kernel_cannot_say():
    def sockets(*counters: tuple[int, int, int]) -> list[Socket]:
        return [Socket(inode, f"l:{inode}", f"r:{inode}", s, r) for inode, s, r in counters]

    readings = iter([sockets((1, 100, 10)), sockets((1, 150, 20), (2, 5, 5)), sockets((2, 7, 9)), None])
    meter = WireMeter(lambda: 42, own=set, read=lambda: next(readings), holds=lambda p: {1, 2} if p == 42 else set(),
                      parent=lambda p: None)  # fmt: skip
    assert meter.take() == ((100, 10), (0, 0))
    assert meter.take() == ((55, 15), (0, 0))  # 1 grew, 2 opened
    assert meter.take() == ((2, 4), (0, 0))  # 1 closed: its 150 / 20 stay counted
    assert meter.take() is None  # unreadable
    assert WireMeter(lambda: None, own=set).take() is None  # no daemon found


def test_a_protocol_names_its_source_by_the_servicer_method_whatever_its_namespace():
    from dilocox_p2p.swarm.protocol_bytes import SOURCES, source_of

    assert source_of("run_1a2b_s0::DilocoxAverager.rpc_aggregate_part") == "exchange"
    assert source_of("run_1a2b_s3::DilocoxAverager.rpc_join_group") == "matchmaking"
    assert source_of("DHTProtocol.rpc_find") == "dht"
    assert source_of("run_1a2b_s0::DilocoxAverager.rpc_push_member") == "pushes"
    assert source_of("run_1a2b_s0::DilocoxAverager.rpc_download_round") == "state"
    assert source_of("dilocox.v1.Hello") == "hello"
    assert source_of("/ipfs/ping/1.0.0") == "other"
    assert set(map(source_of, ["x.rpc_download_average", "y.rpc_download_message"])) <= set(SOURCES)


def test_the_relay_nodes_are_found_by_the_circuit_addresses_of_relayed_connections_with_or_without_their_ip():
    from dilocox_p2p.swarm.wire_meter import relayed_endpoints

    connections = [
        ("QmRelay", ["/ip4/10.0.0.1/tcp/4001"]),  # the relay node itself, connected directly
        ("QmNated", ["/ip4/10.0.0.1/tcp/4001/p2p/QmRelay/p2p-circuit"]),  # a peer reached through it
        ("QmOther", ["/p2p/QmRelay2/p2p-circuit"]),  # through a relay named by its peer id alone
        ("QmRelay2", ["/ip6/fd00::2/tcp/4002"]),
        ("QmPublic", ["/ip4/10.0.0.3/tcp/4003"]),  # direct: no relay
    ]
    assert relayed_endpoints(connections) == {"10.0.0.1:4001", "fd00::2:4002"}
    assert relayed_endpoints([("QmPublic", ["/ip4/10.0.0.3/tcp/4003"])]) == set()
    assert relayed_endpoints([("QmLost", ["/p2p/QmGone/p2p-circuit"])]) == set()  # a relay it has no address of


def test_the_relays_an_auto_relay_peer_reserves_on_are_its_initial_peers_that_name_an_ip():
    from dilocox_p2p.swarm.wire_meter import relay_endpoints

    assert relay_endpoints(["/ip4/203.0.113.7/tcp/31337/p2p/QmBoot", "/dns4/boot.example/tcp/31337/p2p/QmB2"]) == {
        "203.0.113.7:31337"}


def test_bytes_on_a_socket_to_a_relay_count_as_relayed_from_the_reading_that_finds_it_and_after_it_closes():
    readings = iter([
        [Socket(1, "10.0.0.5:1", "10.0.0.1:4001", 100, 10), Socket(2, "10.0.0.5:2", "10.0.0.3:4003", 7, 7)],
        [Socket(1, "10.0.0.5:1", "10.0.0.1:4001", 300, 30), Socket(2, "10.0.0.5:2", "10.0.0.3:4003", 9, 9)],
        [Socket(2, "10.0.0.5:2", "10.0.0.3:4003", 10, 10)],  # the relayed connection's socket closed
        [Socket(2, "10.0.0.5:2", "10.0.0.3:4003", 10, 10)],
    ])
    relays = iter([set(), {"10.0.0.1:4001"}, set(), set()])  # the daemon listed the circuit at the second reading
    meter = WireMeter(lambda: 42, own=set, read=lambda: next(readings), holds=lambda p: {1, 2} if p == 42 else set(),
                      parent=lambda p: None, relays=lambda: next(relays))  # fmt: skip
    assert meter.take() == ((107, 17), (0, 0))
    assert meter.take() == ((202, 22), (300, 30))  # all of its bytes: the socket carried the relayed connection
    assert meter.take() == ((1, 1), (0, 0))  # closed: what it moved stays counted, relayed as before
    assert meter.totals() == (310, 40)


def test_a_relay_list_that_fails_counts_every_byte_as_direct():
    def fails() -> set[str]:
        raise TimeoutError("the DHT process is busy")

    sockets = [Socket(1, "10.0.0.5:1", "10.0.0.1:4001", 5, 6)]
    meter = WireMeter(lambda: 1, own=set, read=lambda: sockets, holds=lambda p: {1} if p == 1 else set(),
                      parent=lambda p: None, relays=fails)  # fmt: skip
    assert meter.take() == ((5, 6), (0, 0))
