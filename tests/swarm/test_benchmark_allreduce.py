"""benchmarks/netns/allreduce.py's peers on loopback: the all-reduce part of the netns benchmark exchanges each
strategy between real stage workers, without waiting out a deadline (the lab adds only shaped links).

    pytest tests/swarm/test_benchmark_allreduce.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60  # each peer's --timeout: its start barrier waits this long for the others at most


def test_the_all_reduce_benchmark_exchanges_each_strategy_between_two_peers_without_waiting_out_its_barrier(tmp_path):
    # its peers never said they were at the start barrier (a worker's record names the boundary it starts from
    # there since the two-phase start): each strategy waited out the whole --timeout (300 s each, 35 min in all)
    started = time.monotonic()
    peers = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.netns.allreduce", "--host", str(host), "--peers", "2", "--ip",
             "127.0.0.1", "--leader-ip", "127.0.0.1", "--dir", str(tmp_path), "--strategies", "none", "int8",
             "--repeats", "1", "--preset", "tiny", "--stages", "1", "--timeout", str(TIMEOUT_S)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for host in (0, 1)
    ]
    outputs = [peer.communicate(timeout=4 * TIMEOUT_S)[0] for peer in peers]
    took = time.monotonic() - started
    assert [peer.returncode for peer in peers] == [0, 0], outputs
    rows = [json.loads(line) for line in (tmp_path / "peer0.jsonl").read_text().splitlines()]
    assert [(r["strategy"], r["round"], r["kind"], r["group_size"]) for r in rows] == [
        ("none", 0, "averaged", 2), ("none", 1, "averaged", 2), ("int8", 0, "averaged", 2), ("int8", 1, "averaged", 2)
    ]  # fmt: skip
    assert took < TIMEOUT_S, f"{took:.0f} s: a peer waited out its start barrier ({TIMEOUT_S} s)"
