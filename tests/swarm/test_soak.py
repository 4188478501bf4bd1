"""The short churn soak (benchmarks/soak.py): 4 peers x 2 stages, 15 rounds, a kill + restart, a late
joiner and a frozen peer; the swarm stays in agreement, resumes, leaves nothing behind and learns."""

from __future__ import annotations

import pytest

from benchmarks.soak import parse_args, run_soak

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]


def test_a_short_soak_of_a_kill_a_join_and_a_freeze_keeps_the_swarm_in_agreement_and_learning(tmp_path):
    args = parse_args(["--peers", "4", "--rounds", "15", "--events", "3", "--seed", "1", "--freeze", "25",
                       "--timeout", "800"])  # fmt: skip
    soak, checked = run_soak(args, tmp_path / "churn", chaos=True)
    assert sorted(e.kind for e in soak.events) == ["freeze", "join", "kill"]
    assert all(e.time is not None and e.done_time is not None for e in soak.events), soak.events
    assert not any(checked["violations"].values()), checked["violations"]
    killed = next(p for p in soak.peers if p.kills)
    assert killed.kills[0]["back_round"] is not None  # resumed and back in a group
    assert len(soak.peers) == 5 and all(len(checked["records"][p.index]) > 0 for p in soak.peers)
