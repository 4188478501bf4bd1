"""benchmarks/exchange_phases.py: the phases of finished runs' exchanges, summed per phase.

    pytest tests/unit/test_exchange_phases_benchmark.py -q
"""

from __future__ import annotations

import json

import pytest

from benchmarks import exchange_phases

pytestmark = pytest.mark.unit


def _record(round: int, phases: list[dict | None], kinds: list[str | None]) -> str:
    return json.dumps({"round": round, "exchange_phases": phases, "kinds": kinds})


def test_each_exchange_counts_once_per_phase_and_the_slowest_name_their_run_round_and_stage(tmp_path):
    run = tmp_path / "test_x0" / "peer0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join([
        _record(0, [None, None], [None, None]),  # round 0: nothing averaged yet
        _record(1, [{"wait": 0.5, "matchmaking": 0.3, "transfer": 0.1}, {"wait": 0.25, "matchmaking": 2.0}],
                ["averaged", "borrowed"]),
        '{"round": 2, "exchange',  # a line cut short by a killed peer
    ]) + "\n")  # fmt: skip
    (tmp_path / "test_xcurrent").symlink_to(tmp_path / "test_x0")  # pytest's link to the newest run: not again

    found = exchange_phases.exchanges([tmp_path])
    report = exchange_phases.summarize(found, slowest=2)

    assert report["exchanges"] == 2
    assert report["phases"]["wait"] == {"n": 2, "median": 0.375, "p90": 0.25, "max": 0.5, "total": 0.75}
    assert report["phases"]["transfer"]["n"] == 1
    assert [(s["seconds"], s["phase"], s["round"], s["stage"], s["kind"]) for s in report["slowest"]] == [
        (2.0, "matchmaking", 1, 1, "borrowed"), (0.5, "wait", 1, 0, "averaged")]  # fmt: skip


def test_the_script_writes_its_report_and_says_so_when_no_run_holds_phases(tmp_path, capsys):
    run = tmp_path / "runs" / "peer0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(_record(1, [{"wait": 0.1, "agree": 0.2}], ["averaged"]) + "\n")
    assert exchange_phases.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--name", "p"]) == 0
    written = json.loads((tmp_path / "out" / "p.json").read_text())
    assert written["phases"]["agree"]["total"] == 0.2 and "machine" in written and "date" in written
    assert exchange_phases.main([str(tmp_path / "empty")]) == 1
    assert "no exchange_phases" in capsys.readouterr().err


def test_a_groups_lags_run_from_its_last_members_start_of_the_round_on_every_members_clock(tmp_path):
    # three members of one round's group: each started the round at window[0] - wait, entered the search at
    # window[0], had its group at window[0] + matchmaking and ended before phase 5 after its other phases
    for peer, (start, wait, matchmaking) in enumerate([(100.0, 0.5, 0.3), (100.25, 0.35, 0.2), (100.4, 0.1, 0.2)]):
        run = tmp_path / "swarm" / f"peer{peer}"
        run.mkdir(parents=True)
        phases = {"wait": wait, "matchmaking": matchmaking, "transfer": 0.1, "agree": 0.5}
        window = [start + wait, start + wait + 1.0]
        (run / "metrics.jsonl").write_text("\n".join([
            json.dumps({"round": 1, "exchange_phases": [phases], "kinds": ["averaged"], "allreduce_windows": [window]}),
            json.dumps({"round": 2, "exchange_phases": [phases], "kinds": ["borrowed"], "allreduce_windows": [window]}),
        ]) + "\n")  # fmt: skip
    report = exchange_phases.summarize(exchange_phases.exchanges([tmp_path]))
    g = report["groups"]
    assert g["groups"] == 1  # round 2's group holds a borrower: not a whole group
    assert g["last_start_to_entered"]["median"] == pytest.approx(0.2)  # 100.6 (peer 1) - 100.4 (peer 2)
    assert g["last_start_to_formed"]["median"] == pytest.approx(0.4)  # 100.8 (peers 0 and 1)
    assert g["last_start_to_ended"]["median"] == pytest.approx(0.5)  # 100.9 (peers 0 and 1), agree left out
