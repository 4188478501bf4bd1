"""Volunteers behind home routers train with the others as client members, with no relay and no forwarded
port: each NATed peer's own contribution is in (nearly) every average, and every common round's hashes are
equal (issue 39; swarm/client_member.py).

    sudo pytest tests/netns/test_volunteers_behind_nat.py -q

Host 0 runs a public bootstrap node (no --relay: relays disabled), host 1 a public peer, hosts 2 and 3 a
peer each behind its own router (MASQUERADE, no port forwarding: benchmarks/netlab.py), links shaped to
100 Mbit/s. Every peer joins with the bootstrap as its only initial peer, as a volunteer would. The two
NATed peers cannot open a connection to each other; before client members, their rounds together failed
(benchmarks/results/nat_lab.json: a NATed peer averaged in 0 of 11 rounds, or 2).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.netlab import NetLab
from dilocox_p2p.metrics import read_metrics
from tests.helpers.peers import LIGHT_BATCH

pytestmark = pytest.mark.netns

ROUNDS = 10
PUBLIC, NATED = (1,), (2, 3)


def _join(host: int, boot: str, run_dir) -> list[str]:
    return [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", "nat", "--preset", "tiny", "--stages", "1",
            "--rounds", str(ROUNDS), "--inner-steps", "5", "--mode", "sync", "--min-peers", "3", "--device", "cpu",
            "--progress", "lines", "--set", "inner.threads=1", *LIGHT_BATCH, "--data-seed", str(host),
            "--initial-peers", boot, "--run-dir", str(run_dir)]  # fmt: skip


def test_two_volunteers_behind_nat_average_as_client_members_and_agree_with_the_public_peer(tmp_path):
    with NetLab(n_hosts=4, rate_mbit=100.0, behind_nat=NATED) as lab:
        boot = lab.start_bootstrap(0, tmp_path / "boot")
        peers = {h: lab.popen(h, _join(h, boot, tmp_path / f"peer{h}"), stdout=open(tmp_path / f"peer{h}.out", "w"),
                              stderr=subprocess.STDOUT) for h in (*PUBLIC, *NATED)}  # fmt: skip
        codes = {h: p.wait(timeout=400) for h, p in peers.items()}
    outputs = {h: (tmp_path / f"peer{h}.out").read_text() for h in peers}
    assert all(code == 0 for code in codes.values()), {h: outputs[h][-3000:] for h, c in codes.items() if c}

    records = {h: {r["round"]: r for r in read_metrics(tmp_path / f"peer{h}" / "metrics.jsonl")} for h in peers}
    common = sorted(set.intersection(*(set(r) for r in records.values())))
    assert len(common) >= ROUNDS - 1, {h: sorted(r) for h, r in records.items()}
    for t in common:
        assert len({tuple(r[t]["stage_hashes"]) for r in records.values()}) == 1, f"round {t}: the peers disagree"
    assert all(r["clients"] == [""] for r in records[1].values()), "the public peer took itself for unreachable"
    for h in NATED:
        # it found out by itself, said so with the fix, and averaged as a client member from then on
        log = outputs[h]
        assert "WARN  reachable from the swarm" in log and "Fix: forward TCP port" in log, log[-3000:]
        assert "stage 0 averages as a client member" in log, log[-3000:]
        clients = [t for t, r in records[h].items() if r["clients"][0]]
        assert clients and all(t in clients for t in range(min(clients), ROUNDS)), sorted(clients)
        # its own contribution is in the average it applied (no borrowing, no mending) in at least 80% of its rounds
        kinds = [r["kinds"][0] for r in records[h].values() if r["applied_round"] is not None]
        assert kinds.count("averaged") >= 0.8 * len(kinds), kinds


RELAY_ROUNDS = 4


def test_volunteers_behind_nat_with_auto_relay_count_their_bytes_to_the_relay_apart(tmp_path):
    # issue 39: bytes through relays are counted. The bootstrap node relays (--relay) and each NATed peer reserves a
    # slot on it (--auto-relay). Each NATed peer counts its bytes on its connection to the relay apart
    # (wire_via_relays, swarm/wire_meter.py: an upper bound of what was relayed, the relay node's own DHT traffic
    # with it included): some, and never more than all it moved. The public peer reserves nothing; it counts a relay
    # only where it reached a NATed peer through one
    def join(host: int) -> list[str]:
        argv = _join(host, boot, tmp_path / f"peer{host}")
        argv[argv.index("--rounds") + 1] = str(RELAY_ROUNDS)
        return [*argv, *(["--auto-relay"] if host in NATED else [])]

    hosts = (*PUBLIC, *NATED)
    with NetLab(n_hosts=4, rate_mbit=100.0, behind_nat=NATED) as lab:
        boot = lab.start_bootstrap(0, tmp_path / "boot", relay=True)
        peers = {h: lab.popen(h, join(h), stdout=open(tmp_path / f"peer{h}.out", "w"), stderr=subprocess.STDOUT)
                 for h in hosts}  # fmt: skip
        codes = {h: p.wait(timeout=300) for h, p in peers.items()}
    outputs = {h: (tmp_path / f"peer{h}.out").read_text() for h in hosts}
    assert all(code == 0 for code in codes.values()), {h: outputs[h][-3000:] for h, c in codes.items() if c}
    records = {h: read_metrics(tmp_path / f"peer{h}" / "metrics.jsonl") for h in hosts}
    for h in hosts:
        counted = [r for r in records[h] if r["wire_via_relays"][0] is not None]
        relayed, wire = [r["wire_via_relays"][0] for r in counted], [r["wire_bytes"][0] for r in counted]
        assert counted and all(0 <= a[i] <= b[i] for a, b in zip(relayed, wire) for i in (0, 1)), (h, relayed, wire)
        if h in NATED:
            assert sum(map(sum, relayed)) > 0, (h, relayed)
    last = [records[h][-1] for h in hosts]
    assert len({(r["round"], tuple(r["stage_hashes"])) for r in last}) == 1, "the peers disagree at their last round"
