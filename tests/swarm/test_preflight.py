"""`dilocox-peer doctor` against live nodes: a bootstrap passes; a dead address, a busy port, a loopback
announce address, a node that is not dilocox and one of another protocol version are each named with a fix.

    pytest tests/swarm/test_preflight.py -q
"""

from __future__ import annotations

import socket
import subprocess
import sys

import hivemind
import pytest

from dilocox_p2p.cli.__main__ import main
from dilocox_p2p.wire import PROTOCOL_VERSION
from tests.helpers.bootstrap import Bootstrap, free_port

pytestmark = pytest.mark.swarm

LOCAL = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--preset", "tiny", "--device", "cpu", "--timeout", "3"]


def _line(lines: list[str], *words: str) -> str:
    found = [line for line in lines if all(w in line for w in words)]
    assert len(found) == 1, f"no single line with {words}:\n" + "\n".join(lines)
    return found[0]


def test_doctor_passes_against_a_live_bootstrap_and_names_each_problem_with_its_fix(tmp_path, capsys):
    good = Bootstrap(tmp_path / "good", "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
    newer = Bootstrap(tmp_path / "newer", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                      env={"DILOCOX_FAULTS": "speak_other_protocol"})  # fmt: skip
    plain = None
    try:
        boot, other = good.maddrs()[0], newer.maddrs()[0]
        # the real command: exit 0, every line PASS, the bootstrap recognized
        proc = subprocess.run([sys.executable, "-m", "dilocox_p2p.cli", "doctor", "--initial-peers", boot, *LOCAL,
                               "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)  # fmt: skip
        lines = proc.stdout.strip().splitlines()
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [line for line in lines[:-1] if not line.startswith("PASS")] == [], lines
        assert lines[-1].startswith("all checks passed"), lines
        assert f"dilocox bootstrap 0.1.0, protocol {PROTOCOL_VERSION}" in _line(lines, "initial peer", boot)

        plain = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])  # a libp2p node, not a dilocox one
        not_dilocox = str(plain.get_visible_maddrs()[0])
        dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{boot.rsplit('/', 1)[1]}"
        remote = f"/ip4/203.0.113.7/tcp/31337/p2p/{boot.rsplit('/', 1)[1]}"  # another machine (TEST-NET-3)
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            code = main(["doctor", "--initial-peers", boot, dead, not_dilocox, other, remote, *LOCAL,
                         "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                         "--stages", "1", "--run-dir", str(tmp_path / "run")])  # fmt: skip
        lines = capsys.readouterr().out.strip().splitlines()
        assert code == 1, lines
        assert lines[-1] == "4 check(s) failed", lines
        error = _line(lines, "FAIL", f"port 127.0.0.1:{port}")
        assert "in use" in error and "pass another port" in error
        error = _line(lines, "FAIL", "announce address", "loopback")
        assert "203.0.113.7" in error and "Fix: pass --announce-maddrs /ip4/" in error
        # a stale address of the live bootstrap: refused, named as such; a warning while another initial peer answers
        error = _line(lines, "WARN", dead)
        assert "refused: nothing listens there" in error and "joins through the others" in error and "Fix: start" in error
        error = _line(lines, "FAIL", not_dilocox)
        assert "reachable but not a dilocox node" in error and "Fix: point --initial-peers at" in error
        error = _line(lines, "FAIL", other)
        assert f"runs incompatible version 0.1.0 (protocol {PROTOCOL_VERSION + 1}, ours {PROTOCOL_VERSION})" in error
        assert "Fix: upgrade dilocox-p2p on this machine" in error
        assert _line(lines, remote).startswith("WARN")  # nothing there (refused, timed out, or a middlebox's TCP)
        assert _line(lines, "initial peer", boot).startswith("PASS")
        assert _line(lines, "clock").startswith("PASS")
        # with no initial peer answering, a dead one fails
        assert main(["doctor", "--initial-peers", dead, *LOCAL, "--run-dir", str(tmp_path / "run")]) == 1
        assert _line(capsys.readouterr().out.strip().splitlines(), "FAIL", dead)
    finally:
        if plain is not None:
            plain.shutdown()
        good.kill()
        newer.kill()


def test_join_exits_75_when_no_initial_peer_answers_and_2_when_a_stage_port_is_taken(tmp_path):
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/12D3KooWPfUv6gf1EiQqcHcf457i1pkpsjdMW9R8F92hbH4DMNfZ"
    join = [sys.executable, "-m", "dilocox_p2p.cli", "join", "--preset", "tiny", "--device", "cpu", "--stages", "2"]
    # the peer that cannot join waits for its initial peer to listen (8 s in all) while the other one runs
    unreachable = subprocess.Popen([*join, "--run-dir", str(tmp_path / "a"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                    "--initial-peers", dead], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        with socket.socket() as taken:  # stage 1 of a peer on port P listens on P + 1
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1] - 1
            busy = subprocess.run([*join, "--run-dir", str(tmp_path / "b"), "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
        _, stderr = unreachable.communicate(timeout=120)
    finally:
        if unreachable.poll() is None:
            unreachable.kill()
            unreachable.communicate()
    assert unreachable.returncode == 75, stderr[-3000:]  # temporary: a supervisor retries
    assert "could not join the swarm through --initial-peers" in stderr
    lines = busy.stderr.strip().splitlines()
    assert busy.returncode == 2 and len(lines) == 1 and "--host-maddrs (stage" in lines[0] and "in use" in lines[0], busy.stderr
    assert not (tmp_path / "b").exists()
