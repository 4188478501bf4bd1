"""A volunteer behind a home router: what `dilocox-peer doctor` (and `join`) tell it, and what doctor tells a
machine the swarm can dial.

    sudo pytest tests/netns/test_volunteer_nat.py -q

Host 0 runs a public bootstrap node; host 1 sits behind its own NAT (MASQUERADE, no port forwarding:
benchmarks/netlab.py); host 2 is public. Each runs the real `doctor` with the bootstrap as its only
initial peer: the bootstrap dials each back where it sees it (swarm/dial_back.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.netlab import NetLab

pytestmark = pytest.mark.netns

PORT = 31400


def _doctor(lab: NetLab, host: int, boot: str, run_dir) -> subprocess.CompletedProcess:
    proc = lab.popen(host, [sys.executable, "-m", "dilocox_p2p.cli", "doctor", "--initial-peers", boot, "--preset", "tiny",
                            "--stages", "1", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}", "--run-dir", str(run_dir)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _line(result: subprocess.CompletedProcess, start: str) -> str:
    found = [line for line in result.stdout.splitlines() if line.startswith(start)]
    assert found, result.stdout + result.stderr
    return found[0]


def test_doctor_tells_a_volunteer_behind_nat_that_the_swarm_cannot_dial_it_and_the_fix(tmp_path):
    with NetLab(n_hosts=3, rate_mbit=None, behind_nat=(1,)) as lab:
        boot = lab.start_bootstrap(0, tmp_path / "boot")

        home = _doctor(lab, 1, boot, tmp_path / "home")
        public = _doctor(lab, 2, boot, tmp_path / "public")
        # a peer that joins from behind the NAT says so itself, with the fix, while it trains (alone here)
        joined = lab.popen(1, [sys.executable, "-m", "dilocox_p2p.cli", "join", "--preset", "tiny", "--stages", "1",
                               "--rounds", "2", "--inner-steps", "5", "--device", "cpu", "--progress", "off",
                               "--initial-peers", boot, "--run-dir", str(tmp_path / "peer")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        log, _ = joined.communicate(timeout=180)

    warned = _line(home, "WARN  reachable from the swarm")
    assert f"behind a NAT (its address {lab.ip(1)}; the swarm sees {lab.public_ip(1)})" in warned, warned
    assert f"{lab.public_ip(1)}:{PORT}" in warned and "Other peers cannot dial this one" in warned, warned
    assert f"Fix: forward TCP port {PORT} on the router to this machine" in warned, warned
    assert home.returncode == 0, home.stdout  # a warning: it can still join and train
    assert joined.returncode == 0, log[-3000:]
    said = [line for line in log.splitlines() if "WARN  reachable from the swarm" in line]
    assert said and f"the swarm sees {lab.public_ip(1)}" in said[0] and "Fix: forward TCP port" in said[0], log[-3000:]
    passed = _line(public, "PASS  reachable from the swarm")
    assert f"opened a connection to {lab.ip(2)} at port(s) {PORT}" in passed, passed

