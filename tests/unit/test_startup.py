"""The start-up timeline (RUN_DIR/startup.jsonl): marks per process and life, and the critical path.

    pytest tests/unit/test_startup.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from dilocox_p2p import startup

pytestmark = pytest.mark.unit


def test_a_process_start_time_is_when_the_kernel_started_it():
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); from dilocox_p2p.startup import "
                          "process_start_time; print(process_start_time())"], capture_output=True, text=True,
                         check=True, timeout=60).stdout  # fmt: skip
    started = float(out)
    assert before - 0.05 <= started <= before + 0.45, (before, started)


def test_marks_made_before_the_run_directory_exists_are_written_when_it_is_attached(tmp_path):
    timeline = startup.Timeline(stage=None)
    timeline.mark("process", at=100.0)
    timeline.mark("imports", at=100.5)
    timeline.mark("imports", at=999.0)  # once per life
    assert not (tmp_path / startup.FILE).exists()
    timeline.attach(tmp_path, fresh=True)
    timeline.mark("preflight", at=100.6)
    lines = [json.loads(line) for line in (tmp_path / startup.FILE).read_text().splitlines()]
    assert [(e["phase"], e["time"]) for e in lines] == [("process", 100.0), ("imports", 100.5), ("preflight", 100.6)]


def test_each_life_of_a_peer_is_read_apart_and_its_critical_path_follows_the_lead_stage(tmp_path):
    for life, base in enumerate((100.0, 200.0)):
        launcher = startup.Timeline(stage=None)
        launcher.attach(tmp_path, fresh=life == 0)
        launcher.mark("process", at=base)
        launcher.mark("imports", at=base + 0.1)
        launcher.mark("preflight", at=base + 0.2)
        lead, other = startup.Timeline(stage=0), startup.Timeline(stage=1)
        for t in (lead, other):
            t.attach(tmp_path)
        lead.mark("stage_process", at=base + 2.0)
        other.mark("stage_process", at=base + 2.1)
        lead.mark("corpus", at=base + 2.2)
        lead.mark("dht", at=base + 2.5)  # started before the corpus, done after it
        other.mark("joined", at=base + 9.0)  # another stage's marks are not on the lead's path
        lead.mark("joined", at=base + 2.9)
        lead.mark("first_step", at=base + 3.0)
        lead.mark("first_group", at=base + 5.0)
    lives = startup.read_lives(tmp_path)
    assert len(lives) == 2 and lives[1][0]["time"] == 200.0
    path = startup.phases(lives[1])
    assert [name for name, _ in path] == ["imports", "preflight", "stage_process", "corpus", "dht", "joined", "first_step"]
    assert sum(seconds for _, seconds in path) == pytest.approx(3.0)
    assert startup.phases(lives[0], until="first_group")[-1] == ("first_group", pytest.approx(2.0))


def test_a_torn_line_is_skipped(tmp_path):
    (tmp_path / startup.FILE).write_text('{"phase": "process", "stage": null, "pid": 1, "time": 1.0}\n{"phase": "imp')
    assert startup.read_lives(tmp_path) == [[{"phase": "process", "stage": None, "pid": 1, "time": 1.0}]]


def test_the_stages_imports_leave_scipy_optimize_unloaded_until_hivemind_load_balancing_uses_it():
    code = textwrap.dedent("""
        import inspect, sys
        import dilocox_p2p.stage_process, dilocox_p2p.swarm.worker  # the fork server's imports (launch.py)
        inspect.getmodule(inspect)  # reads every module's __file__, as torch does at import
        print("scipy.optimize._optimize" in sys.modules)
        from hivemind.averaging.load_balancing import load_balance_peers
        print(load_balance_peers(100, [1.0, 2.0, None, 3.0]))
        import scipy, scipy.optimize
        print(sys.modules["scipy.optimize"] is scipy.optimize and callable(scipy.optimize.linprog))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["False", "(0, 24, 23, 53)", "True"], out.stdout
