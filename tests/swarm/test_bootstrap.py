"""`dilocox-bootstrap`: a stable entry point that peers train through, that plain hivemind clients can
read, that reports its health, and that refuses bad flags in one line.

One test covers the restart, health, relay, Hello, training and plain-client checks with one
bootstrap state and two peers (starting processes is the cost on a 2-core machine); the error
paths run `main()` in-process, plus one real process.

    pytest tests/swarm/test_bootstrap.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import hivemind
import pytest
from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

from dilocox_p2p.bootstrap import BootstrapNode, BootstrapOptions
from dilocox_p2p.cli.bootstrap import main as bootstrap_main
from dilocox_p2p.identity import peer_id_of, public_key_of, worker_identity
from dilocox_p2p.logs import set_log_context
from dilocox_p2p.proto_gen import envelope_pb2, swarm_pb2
from dilocox_p2p.swarm.hello import say_hello
from tests.helpers.bootstrap import Bootstrap, free_port, health_status
from tests.helpers.peers import Peer

pytestmark = pytest.mark.swarm

RELAY_HOP = "/libp2p/circuit/relay/0.2.0/hop"


async def _connect(maddr: str) -> tuple[P2P, PeerID]:
    m = Multiaddr(maddr)
    peer_id = PeerID.from_base58(m.value_for_protocol("p2p"))
    p2p = await P2P.create(dht_mode="client", auto_nat=False, nat_port_map=False)
    await p2p._client.connect(peer_id, [m.decapsulate(Multiaddr(f"/p2p/{peer_id}"))])
    return p2p, peer_id


async def _hello(maddr: str):
    p2p, peer_id = await _connect(maddr)
    try:
        return await say_hello(p2p, peer_id, timeout=5)
    finally:
        await p2p.shutdown()


def _uvarint(data: bytes, i: int = 0) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value, shift, i = value | (byte & 0x7F) << shift, shift + 7, i + 1
        if byte < 0x80:
            return value, i


async def _relay_reservation_status(maddr: str) -> int:
    """Ask for a circuit-relay v2 reservation (HopMessage{type: RESERVE}); return the reply's status (100 = OK)."""
    p2p, peer_id = await _connect(maddr)
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, RELAY_HOP)
        writer.write(b"\x02\x08\x00")  # uvarint length 2, field 1 (type) = 0 (RESERVE)
        await writer.drain()
        head = await asyncio.wait_for(reader.read(10), 5)
        size, start = _uvarint(head)
        body = head[start:] + await asyncio.wait_for(reader.readexactly(size - len(head) + start), 5)
        writer.close()
        fields, i = {}, 0
        while i < len(body):  # HopMessage: 1 type, 3 reservation, 5 status (varints and bytes only)
            key, i = _uvarint(body, i)
            if key & 7 == 0:
                fields[key >> 3], i = _uvarint(body, i)
            else:
                size, i = _uvarint(body, i)
                fields[key >> 3], i = body[i : i + size], i + size
        return fields.get(5, -1)
    finally:
        await p2p.shutdown()


def _read_config_record(bootstrap_maddr: str, run_id: str, config_hash: str) -> dict:
    """What an unmodified hivemind client reads under the run's config key, joining through the bootstrap only."""
    client = hivemind.DHT(initial_peers=[bootstrap_maddr], start=True)
    try:
        found = client.get(f"{run_id}:config:{config_hash}", latest=True)
    finally:
        client.shutdown()
    assert found is not None and isinstance(found.value, dict), found
    return {subkey: item.value for subkey, item in found.value.items()}


def test_two_peers_given_only_a_restarted_bootstrap_train_together_and_a_plain_client_reads_their_record(tmp_path):
    port = free_port()
    state = tmp_path / "state"
    flags = ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"]
    first = Bootstrap(state, *flags)
    second, peers = None, []
    try:
        # a fixed port and a kept key: the same address after a restart; health says SERVING
        before = first.maddrs()
        assert before == [f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_of(worker_identity(state / 'identity.key'))}"]
        assert (state / "identity.key").stat().st_mode & 0o777 == 0o600
        assert first.health() == "SERVING"
        assert first.stop() == 0, first.log()
        second = Bootstrap(state, *flags, "--relay")
        assert second.maddrs() == before == (state / "multiaddrs.txt").read_text().split()
        assert second.health() == "SERVING"
        hello = asyncio.run(_hello(before[0]))
        assert (hello.software, hello.role, hello.run_id) == ("dilocox-p2p", "bootstrap", "")
        assert abs(hello.time - time.time()) < 5
        assert asyncio.run(_relay_reservation_status(before[0])) == 100  # --relay: reservations granted

        # two peers that know only the bootstrap find each other and average in a group of 2
        run = ["--run-id", "via-bootstrap", "--stages", "1", "--rounds", "3", "--min-peers", "2",
               "--initial-peers", before[0]]  # fmt: skip
        peers = [Peer(tmp_path / f"peer{i}", [*run, "--data-seed", str(i)]) for i in range(2)]
        reply = asyncio.run(_hello(peers[0].maddrs()[0]))  # stage workers answer Hello too
        assert (reply.role, reply.run_id) == ("peer", "via-bootstrap")
        for peer in peers:
            assert peer.wait(timeout=180) == 0, peer.output()
        assert all(any(r["group_size"] == 2 for r in peer.metrics()) for peer in peers), peers[0].output()

        # the peers are gone: only the bootstrap holds their config record, and a plain hivemind client reads it
        config_hash = json.loads((peers[0].run_dir / "run.json").read_text())["config_hash"]
        records = _read_config_record(before[0], "via-bootstrap", config_hash)
        assert len(records) >= 1
        for worker_id, blob in records.items():
            signed = envelope_pb2.SignedEnvelope.FromString(blob)
            public_key_of(worker_id).verify(signed.signature, signed.body)  # byte for byte what the worker signed
            body = envelope_pb2.Envelope.FromString(signed.body)
            assert (body.run_id, body.topic) == ("via-bootstrap", f"via-bootstrap:config:{config_hash}")
            assert swarm_pb2.ConfigRecord.FromString(body.payload).config_hash == config_hash
        assert second.stop() == 0, second.log()
    finally:
        for peer in peers:
            if peer.proc.poll() is None:
                peer.kill()
            peer.log.close()
        for node in (first, second):
            if node is not None:
                node.kill()


def test_health_and_metrics_say_down_and_the_node_exits_1_when_its_dht_process_dies(tmp_path):
    opts = BootstrapOptions(state_dir=tmp_path / "state", host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                            metrics_addr="127.0.0.1:0", status_period=0.1)  # fmt: skip
    node = BootstrapNode.start(opts)
    try:
        metrics_url = f"http://127.0.0.1:{node.metrics.server.server_port}/metrics"
        assert health_status(node.health.address) == "SERVING"
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        assert "dilocox_bootstrap_up 1.0" in text and "dilocox_bootstrap_routing_table_peers 0.0" in text
        assert "dilocox_bootstrap_uptime_seconds" in text
        children = Path(f"/proc/{node.dht.pid}/task/{node.dht.pid}/children").read_text().split()  # its p2pd
        os.kill(node.dht.pid, signal.SIGKILL)  # as the OOM killer would
        node.dht.join(10)
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)
        assert node.serve(threading.Event()) == 1
        assert health_status(node.health.address) == "NOT_SERVING"
        assert "dilocox_bootstrap_up 0.0" in urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    finally:
        node.stop()
        set_log_context(peer=None)


@pytest.fixture
def in_process():
    """main() installs SIGTERM/SIGINT handlers: put them back afterwards (tests/conftest.py restores logging)."""
    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in signals.items():
        signal.signal(signum, handler)


def _one_line_error(capsys, argv: list[str]) -> str:
    try:
        code = bootstrap_main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, f"{argv}: exit {code}\n{err}"
    assert len(lines) == 1 and "Traceback" not in err, f"{argv}:\n{err}"
    assert lines[0].startswith("dilocox-bootstrap: error: "), lines[0]
    return lines[0]


def test_bad_flags_an_unsafe_or_unreadable_identity_and_a_busy_port_are_one_line_errors(tmp_path, capsys, in_process):
    loose = tmp_path / "loose.key"
    worker_identity(loose)
    loose.chmod(0o644)
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"\xff" * 40)
    garbage.chmod(0o600)
    state = ["--state-dir", str(tmp_path / "state"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags in (["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"], ["--health-addr", f"127.0.0.1:{port}"],
                      ["--metrics-addr", f"127.0.0.1:{port}"]):  # fmt: skip
            error = _one_line_error(capsys, [*state, *flags])
            assert flags[0] in error and "in use" in error and "pass another port" in error, error
        assert not (tmp_path / "state" / "identity.key").exists()  # refused before anything was created

        # the real console process: one line on stderr, exit 2, nothing left running
        proc = subprocess.run([sys.executable, "-m", "dilocox_p2p.cli.bootstrap", *state, "--health-addr",
                               f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.strip().count("\n") == 0 and "in use" in proc.stderr, proc.stderr

    assert "unrecognized arguments: --no-such-flag" in _one_line_error(capsys, [*state, "--no-such-flag"])
    error = _one_line_error(capsys, [*state, "--identity", str(loose)])
    assert "mode 0644" in error and f"chmod 600 {loose}" in error
    error = _one_line_error(capsys, [*state, "--identity", str(garbage)])
    assert "unreadable" in error and "delete it" in error
    error = _one_line_error(capsys, [*state, "--identity", str(tmp_path)])
    assert "not a file" in error
    error = _one_line_error(capsys, [*state, "--initial-peers", "/ip4/203.0.113.7/tcp/31337"])
    assert "--initial-peers" in error and "peer id" in error
    error = _one_line_error(capsys, [*state, "--host-maddrs", "0.0.0.0:31337"])
    assert "--host-maddrs" in error and "/ip4/0.0.0.0/tcp/31337" in error
    error = _one_line_error(capsys, [*state, "--announce-maddrs", "/ip4/203.0.113.7/tcp/0"])
    assert "--announce-maddrs" in error and "port 0" in error
