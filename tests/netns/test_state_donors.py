"""Joiners take the swarm's state in pieces from several donors at once, each piece checked on arrival, and drop a
donor that lies or stalls (issue 39; swarm/state_pieces.py).

    sudo pytest tests/netns/test_state_donors.py -q

Host 0 runs a bootstrap node; hosts 1-5 a donor each on a 20 Mbit/s link (a home uplink): three honest, one that
serves every piece of its state altered and signed (it lies), one that holds every request for a piece 60 s (its
link has all but stopped); hosts 6-9 a joiner each on 100 Mbit/s, all four started at once once the donors train.
Before, every joiner took its whole state from the same donor (the most advanced holder of the majority's hash),
as in hivemind#169: one uplink carried every state (benchmarks/state_donors.py: 8.1 s against 3.0 s in pieces).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys

import pytest

from benchmarks.netlab import NetLab
from benchmarks.soak import worker_peer_id
from dilocox_p2p.metrics import read_metrics
from tests.helpers.waits import wait_for

pytestmark = pytest.mark.netns

HONEST, LIAR, STALLED, JOINERS = (1, 2, 3), 4, 5, (6, 7, 8, 9)
FAULTS = {LIAR: "corrupt_served_piece:stage=0", STALLED: "stall_served_piece:stage=0"}
TOOK = re.compile(r"took the state of round \d+ from (\d+) donor")


def _join(host: int, boot: str, run_dir, *extra: str) -> list[str]:
    # 15 inner steps a round: a donor keeps a state one round past, and with 5 the donors' rounds (1-6 s while the
    # joiners start) outran the joiners' downloads (2-8 s on 2 cores): every joiner's first download saw 3 of 5
    # donors move on, and one's second too, which then took a whole state from one donor (CI run 239)
    return [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", "donors", "--preset", "tiny", "--stages", "1",
            "--rounds", "500", "--inner-steps", "15", "--mode", "delayed", "--device", "cpu", "--progress", "lines",
            "--set", "inner.threads=1", "--data-seed", str(host), "--initial-peers", boot, "--run-dir", str(run_dir),
            *extra]  # fmt: skip


def _records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def test_four_joiners_at_once_take_the_state_in_pieces_from_every_donor_and_drop_the_liar_and_the_stalled_one(tmp_path):
    donors = (*HONEST, LIAR, STALLED)
    procs = {}

    def outputs() -> str:
        return "\n".join(f"--- peer{h}\n{(tmp_path / f'peer{h}.out').read_text()[-2500:]}" for h in procs)

    with NetLab(n_hosts=1 + len(donors) + len(JOINERS), rate_mbit=100.0) as lab:
        for host in donors:
            lab.set_rate(host, 20.0)
        boot = lab.start_bootstrap(0, tmp_path / "boot")

        def start(host: int, *extra: str) -> None:
            env = {**os.environ, **({"DILOCOX_FAULTS": FAULTS[host]} if host in FAULTS else {})}
            procs[host] = lab.popen(host, _join(host, boot, tmp_path / f"peer{host}", *extra),
                                    stdout=open(tmp_path / f"peer{host}.out", "w"), stderr=subprocess.STDOUT, env=env)  # fmt: skip

        for host in donors:
            start(host, "--min-peers", str(len(donors)))
        wait_for(lambda: any(r["round"] >= 1 for r in _records(tmp_path / "peer1")), 300,
                 lambda: f"the donors never trained two rounds:\n{outputs()}", every=0.5)  # fmt: skip
        for host in JOINERS:  # all at once
            start(host)
        wait_for(lambda: all(len(_records(tmp_path / f"peer{h}")) >= 2 for h in JOINERS), 300,
                 lambda: f"a joiner never trained two rounds:\n{outputs()}", every=0.5)  # fmt: skip
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {h: p.wait(timeout=120) for h, p in procs.items()}
    assert all(c == 128 + signal.SIGTERM for c in codes.values()), (codes, outputs())

    liar, stalled = worker_peer_id(tmp_path / f"peer{LIAR}", 0), worker_peer_id(tmp_path / f"peer{STALLED}", 0)
    theirs = {r["round"]: r["stage_hashes"] for r in _records(tmp_path / "peer1")}
    served: collections.Counter[str] = collections.Counter()
    refusals = 0
    for host in JOINERS:
        records = _records(tmp_path / f"peer{host}")
        assert records[0]["round"] >= 2 and records[0]["faults"]["catch_ups"] >= 1, records[0]  # it took the state
        for record in records:
            served.update(record["state_donors"][0])
        log = (tmp_path / f"peer{host}" / "logs" / "stage0.log").read_text()
        # in pieces from several donors (a download whose every piece went GONE, the donors having moved on, falls
        # back to a whole state from one donor: a joiner may take a state more than once, one of them so)
        assert any(int(n) >= 2 for n in TOOK.findall(log)), log[-3000:]
        # each joiner drops the liar: for an altered piece (checked on arrival), or, where an honest donor asked
        # later delivered the liar's piece first, as slow before its altered piece came (one joiner of four in CI
        # run 214, on a fast machine: it was never served a byte of the liar's all the same, asserted below)
        assert re.search(f"donor {liar} asked for no more pieces: (refused|slow): piece", log), log[-3000:]
        refusals += f"donor {liar} asked for no more pieces: refused: piece" in log
        assert f"donor {stalled} asked for no more pieces: slow: piece" in log, log[-3000:]
        common = [r for r in records if r["round"] in theirs]
        assert common and all(r["stage_hashes"] == theirs[r["round"]] for r in common), "a joiner differs from the swarm"
    assert refusals >= 1, "no joiner refused an altered piece of the liar's: the check on arrival was not shown"
    assert liar not in served and stalled not in served, {d[-6:]: n for d, n in served.items()}
    total = sum(served.values())
    assert max(served.values()) <= total / 2, {d[-6:]: round(n / total, 2) for d, n in served.items()}
