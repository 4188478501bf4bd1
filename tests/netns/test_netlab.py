"""The network lab itself (benchmarks/netlab.py): a benchmark stopped with SIGTERM leaves nothing behind.

    sudo pytest tests/netns/test_netlab.py -q
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def test_a_lab_whose_process_is_sent_sigterm_removes_its_namespaces_links_and_processes():
    # as a benchmark stopped by its operator or a CI timeout: SIGTERM, no handler of its own
    code = textwrap.dedent("""
        import sys, time
        from benchmarks.netlab import NetLab
        with NetLab(n_hosts=2, rate_mbit=10, behind_nat=(1,)) as lab:
            sleeper = lab.popen(1, ["sleep", "300"])
            print(lab.id, sleeper.pid, flush=True)
            time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        lab_id, sleeper = proc.stdout.readline().split()
        assert f"dlx{lab_id}h1" in _ip("netns", "list")
        assert Path(f"/proc/{sleeper}").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"dlx{lab_id}" not in _ip("netns", "list")
    assert f"dlx{lab_id}" not in _ip("link", "show")
    assert f"dlx{lab_id}" not in subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
    assert not Path(f"/proc/{sleeper}").exists() or "Z" in Path(f"/proc/{sleeper}/stat").read_text().split()[2]
