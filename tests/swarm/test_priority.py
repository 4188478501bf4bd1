"""The swarm's helper processes run below training's CPU priority (see dilocox_p2p/swarm/priority.py).

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

pytestmark = pytest.mark.swarm


def _nice(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_dht_p2p_daemon_and_averager_run_background_nice_levels_below_training():
    cfg = load_config(overrides={"swarm.host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "swarm.background_nice": 7})
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
        assert _nice(0) == own, "training itself keeps its priority"
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
