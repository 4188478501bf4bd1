"""CPU priority of the swarm's helper processes against training (`swarm.helper_nice`), and of the whole
peer once it trains (`swarm.settled_nice`; see dilocox_p2p/swarm/priority.py), checked on real processes,
thread by thread.

    pytest tests/swarm/test_priority.py -q
"""

from __future__ import annotations

import os
import time
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
    (server,) = _fork_server(peer)
    out = {}
    for stage in _children(server):
        helpers = _children(stage) + [p for h in _children(stage) for p in _children(h)]
        out[stage] = (_thread_nices(stage), [n for h in helpers for n in _thread_nices(h)])
    return out


def _fork_server(peer: Peer) -> list[int]:
    return [c for c in _children(peer.proc.pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _thread_nices(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def _autogroup_nice(pid: int) -> int | None:
    """The nice of `pid`'s autogroup; None where it has none of its own: the file reads empty for a process
    in the first session of the machine or container (the root group) or in a cpu cgroup of its own."""
    text = Path(f"/proc/{pid}/autogroup").read_text() if Path(f"/proc/{pid}/autogroup").exists() else ""
    return int(text.split("nice")[1]) if "nice" in text else None


def _wait_settled(peer: Peer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all("trains now:" in peer.stage_log(stage) for stage in (0, 1)):
        assert peer.proc.poll() is None, peer.output()
        assert time.monotonic() < deadline, f"the stages did not settle in {timeout}s:\n{peer.output()}"
        time.sleep(0.1)


@pytest.mark.parametrize(("helper_nice", "settled_nice"), [(0, 10), (-10, 4)])  # the defaults; training below helpers
def test_every_thread_of_a_stage_and_of_its_helpers_gets_the_configured_priority_and_drops_once_it_trains(
    tmp_path, helper_nice, settled_nice
):
    own = _nice(0)
    own_group = _autogroup_nice(os.getpid())
    flags = ["--set", f"swarm.helper_nice={helper_nice}", "--set", f"swarm.settled_nice={settled_nice}"]
    peer = Peer(tmp_path / "peer", ["--rounds", "200", "--inner-steps", "10", *flags], fresh=True)
    try:
        _wait_settled(peer, timeout=180)
        stages = _stage_and_helper_threads(peer)
        assert len(stages) == 2, stages
        for stage_threads, helper_threads in stages.values():
            assert set(stage_threads) == {min(own + max(-helper_nice, 0) + settled_nice, 19)}, stage_threads  # gloo's too
            assert set(helper_threads) == {min(own + max(helper_nice, 0) + settled_nice, 19)}, helper_threads
        (server,) = _fork_server(peer)
        assert _nice(peer.proc.pid) == own and set(_thread_nices(server)) == {own}, "launcher and fork server keep theirs"
        # the peer leads its own session (start_new_session): its autogroup, which Linux weighs against other
        # sessions before any nice counts, is lowered as well; the test's own session is left alone. Where the
        # peer has no autogroup (no CONFIG_SCHED_AUTOGROUP, or a cpu cgroup of its own), it says it lowered none.
        peer_group = _autogroup_nice(peer.proc.pid)
        assert _autogroup_nice(os.getpid()) == own_group
        if peer_group is None:
            assert "and so does its session" not in peer.stage_log(0) + peer.stage_log(1)
        else:
            assert peer_group == settled_nice
    finally:
        peer.kill()
        peer.log.close()
