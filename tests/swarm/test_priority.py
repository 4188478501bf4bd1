"""CPU priority of the swarm's helper processes against training (`swarm.helper_nice`, see
dilocox_p2p/swarm/priority.py), checked on real processes.

    pytest tests/swarm/test_priority.py -q
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dilocox_p2p.config import load_config
from dilocox_p2p.swarm.averager import DilocoxAverager
from dilocox_p2p.swarm.dht import start_dht
from tests.helpers.peers import Peer

pytestmark = pytest.mark.swarm


def _nice(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_with_positive_helper_nice_the_dht_its_p2p_daemon_and_the_averager_run_below_training():
    cfg = load_config(overrides={"swarm.host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "swarm.helper_nice": 7})
    own = _nice(0)
    dht = start_dht(cfg.swarm, stage=0, identity_path=None)
    averager = None
    try:
        averager = DilocoxAverager(
            [torch.zeros(4)], dht, run_id="nice", config_hash="0" * 64, stage=0, nice=7, prefix="nice_s0", start=True
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


def test_by_default_a_peers_stage_processes_train_ten_levels_below_their_helpers(tmp_path):
    peer = Peer(tmp_path / "peer", ["--rounds", "200", "--inner-steps", "10"])
    try:
        peer.wait_for_round(0, timeout=180)
        # the launcher's children: the stage processes (each with its DHT and averager) and a resource tracker
        helpers = {stage: _children(stage) for stage in _children(peer.proc.pid)}
        stages = [stage for stage, theirs in helpers.items() if theirs]
        assert len(stages) == 2, helpers
        for stage in stages:
            assert all(_nice(stage) == _nice(h) + 10 for h in helpers[stage]), (stage, helpers[stage])
    finally:
        peer.kill()
        peer.log.close()
