"""CPU priority of the swarm's helper processes against training (`swarm.helper_nice`, see
dilocox_p2p/swarm/priority.py), checked on real processes, thread by thread.

    pytest tests/swarm/test_priority.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dilocox_p2p.swarm.averager import DilocoxAverager
from tests.helpers.peers import Peer
from tests.helpers.signed import signed_node

pytestmark = pytest.mark.swarm


def _nice(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_with_positive_helper_nice_the_dht_its_p2p_daemon_and_the_averager_run_below_training():
    own = _nice(0)
    dht, signer, gate = signed_node("nice", helper_nice=7)
    averager = None
    try:
        averager = DilocoxAverager(
            [torch.zeros(4)], dht, run_id="nice", config_hash="0" * 64, stage=0, nice=7, prefix="nice_s0", start=True,
            signer=signer, gate=gate,
        )
        p2p_daemons = _children(dht.pid)
        assert p2p_daemons, "the DHT process should have started its p2p daemon"
        assert _nice(dht.pid) == min(own + 7, 19)
        assert all(_nice(pid) == min(own + 7, 19) for pid in p2p_daemons)
        assert _nice(averager.pid) == min(own + 7, 19)
        assert _nice(0) == own, "the caller keeps its priority"
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


def _stage_and_helper_threads(peer: Peer) -> dict[int, tuple[list[int], list[int]]]:
    """For each stage process of the peer (children of its fork server): the nice levels of its threads,
    and of its helper processes' threads (DHT, averager, p2p daemon)."""
    (server,) = [c for c in _children(peer.proc.pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    out = {}
    for stage in _children(server):
        helpers = _children(stage) + [p for h in _children(stage) for p in _children(h)]
        out[stage] = (_thread_nices(stage), [n for h in helpers for n in _thread_nices(h)])
    return out


def _thread_nices(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.parametrize("helper_nice", [0, -10])  # the default; training below its helpers
def test_every_thread_of_a_stage_and_of_its_helpers_gets_the_configured_priority(tmp_path, helper_nice):
    peer = Peer(tmp_path / "peer", ["--rounds", "200", "--inner-steps", "10", "--set", f"swarm.helper_nice={helper_nice}"])
    try:
        peer.wait_for_round(0, timeout=180)
        stages = _stage_and_helper_threads(peer)
        assert len(stages) == 2, stages
        for stage_threads, helper_threads in stages.values():
            assert len(set(stage_threads)) == 1, f"threads of one stage differ: {stage_threads}"  # gloo's included
            assert helper_threads and len(set(helper_threads)) == 1, helper_threads
            assert helper_threads[0] - stage_threads[0] == helper_nice
    finally:
        peer.kill()
        peer.log.close()
