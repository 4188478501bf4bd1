"""swarm/wire_meter.py: a p2p daemon's bytes, read from `ss -tinp`'s tcp_info, kept across sockets that close.

    pytest tests/unit/test_wire_meter.py -q
"""

from __future__ import annotations

import os
import shutil
import socket

import pytest

from dilocox_p2p.swarm.wire_meter import Socket, WireMeter, parse_ss, read_sockets

pytestmark = pytest.mark.unit

# what `ss -tinpH` printed on this project's CI machine (iproute2 6.1), cut short: a socket of daemon 11169, one
# it shares with a python process that started it (inherited), and another daemon's
SS = """\
ESTAB 0      0               127.0.0.1:43075          127.0.0.1:43815 users:(("p2pd",pid=11169,fd=10))
\t bbr wscale:10,10 rto:204 rtt:2.668/2.838 mss:51200 cwnd:17 bytes_sent:25322 bytes_retrans:408 bytes_acked:24914 bytes_received:25505 segs_out:222
ESTAB 96     0               127.0.0.1:38225          127.0.0.1:45456 users:(("python",pid=10193,fd=17),("p2pd",pid=11169,fd=17))
\t bbr wscale:10,10 rto:204 rtt:2.719/3.253 bytes_sent:5633657 bytes_retrans:48 bytes_acked:5633609 bytes_received:6782500
ESTAB 0      0               127.0.0.1:22898          127.0.0.1:37951 users:(("p2pd",pid=9033,fd=11))
\t bbr wscale:10,10 rto:204 rtt:1.414/2.53 bytes_sent:8904991 bytes_acked:8886331 bytes_received:8863877
"""


def test_each_socket_is_read_with_its_owners_and_what_it_sent_and_received():
    assert parse_ss(SS) == [
        Socket("127.0.0.1:43075", "127.0.0.1:43815", frozenset({11169}), 25322, 25505),
        Socket("127.0.0.1:38225", "127.0.0.1:45456", frozenset({10193, 11169}), 5633657, 6782500),
        Socket("127.0.0.1:22898", "127.0.0.1:37951", frozenset({9033}), 8904991, 8863877),
    ]


def test_a_daemon_counts_its_own_sockets_but_not_inherited_ones_nor_those_to_its_peers_other_stages():
    mine = Socket("10.0.0.1:4001", "10.0.0.2:4001", frozenset({7}), 100, 10)  # to another peer
    inherited = Socket("10.0.0.1:5000", "10.0.0.2:5000", frozenset({7, 3}), 10**6, 10**6)  # a pipeline socket
    to_stage_1 = Socket("127.0.0.1:4001", "127.0.0.1:4002", frozenset({7}), 50, 50)
    stage_1_end = Socket("127.0.0.1:4002", "127.0.0.1:4001", frozenset({8}), 50, 50)
    meter = WireMeter(lambda: 7, own=lambda: {7, 8}, read=lambda: [mine, inherited, to_stage_1, stage_1_end])
    assert meter.take() == (100, 10)
    other_peer = WireMeter(lambda: 7, own=lambda: {7}, read=lambda: [mine, to_stage_1, stage_1_end])
    assert other_peer.take() == (150, 60)  # daemon 8 is another peer's: the loopback connection counts


def test_a_socket_that_closed_keeps_what_it_had_moved_and_a_reused_address_pair_counts_afresh():
    def sockets(*counters: tuple[str, int, int]) -> list[Socket]:
        return [Socket(f"l:{k}", f"r:{k}", frozenset({42}), s, r) for k, s, r in counters]

    readings = iter([sockets(("a", 100, 10)), sockets(("a", 150, 20), ("b", 5, 5)), sockets(("b", 7, 9)),
                     sockets(("b", 1, 1)), None])  # fmt: skip
    meter = WireMeter(lambda: 42, own=set, read=lambda: next(readings))
    assert meter.take() == (100, 10)
    assert meter.take() == (55, 15)  # a grew, b opened
    assert meter.take() == (2, 4)  # a closed: its 150 / 20 stay counted
    assert meter.take() == (1, 1)  # b's address pair came back with smaller counters: a new socket
    assert meter.take() is None  # unreadable: nothing is made up
    assert WireMeter(lambda: None, own=set).take() is None  # no daemon found


def test_a_real_sockets_bytes_are_read_from_the_kernel():
    if shutil.which("ss") is None:  # CI installs iproute2 (the netns tier needs it too)
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)("needs iproute2's ss")
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
    finally:
        for s in (client, accepted, server):
            s.close()
    assert found is not None
    mine = {(s.sent, s.received) for s in found if os.getpid() in s.owners}
    assert {(100_000, 3000), (3000, 100_000)} <= mine, found  # the two ends of the connection
