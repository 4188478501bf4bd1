"""A peer's log: hivemind's lines in the peer's own format and files, and a step that found no group as one line.

    pytest tests/unit/test_logs.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.artifacts import ROOT

pytestmark = pytest.mark.unit


def _peer_logging(tmp_path: Path, body: str, *, hivemind_first: bool) -> tuple[list[dict], str]:
    """Run `body` in a fresh interpreter whose logging a stage process set up (JSON to a file and stderr), with
    hivemind imported before init_logging (a peer forked from a warm interpreter) or after it (a stage worker that
    imports the swarm once it runs): the file's JSON records and stderr."""
    log = tmp_path / "stage0.log"
    code = textwrap.dedent(f"""
        import logging
        {"import hivemind" if hivemind_first else ""}
        from dilocox_p2p.logs import init_logging, route_hivemind_logs, set_log_context
        init_logging("info", fmt="json", file={str(log)!r})
        set_log_context(stage=0, round=7)
        import hivemind
        route_hivemind_logs()
    """) + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in log.read_text().splitlines()], out.stderr


@pytest.mark.parametrize("hivemind_first", [True, False], ids=["hivemind-imported-first", "hivemind-imported-after"])
def test_hivemind_logs_in_the_peers_format_and_file_with_its_stage_and_round(tmp_path, hivemind_first):
    records, stderr = _peer_logging(tmp_path, """
        source = logging.getLogger("hivemind.dht.node")
        source.info("chatty at info")
        source.warning("a warning of hivemind's")
    """, hivemind_first=hivemind_first)  # fmt: skip

    assert [(r["logger"], r["level"], r["message"], r.get("stage"), r.get("round")) for r in records] == [
        ("hivemind.dht.node", "WARN", "a warning of hivemind's", 0, 7)]  # fmt: skip (hivemind names WARNING "WARN")
    assert json.loads(stderr.strip().splitlines()[-1])["message"] == "a warning of hivemind's"


def test_a_step_that_found_no_group_is_one_warning_line_and_other_failures_keep_their_traceback(tmp_path):
    records, stderr = _peer_logging(tmp_path, """
        from hivemind.averaging.allreduce import AllreduceException
        source = logging.getLogger("hivemind.averaging.averager")
        for e in (AllreduceException("Averaging step failed: could not find a group"), KeyError("another failure")):
            try:
                raise e
            except Exception as caught:
                source.exception(caught)  # as DecentralizedAverager._step logs a failed step
    """, hivemind_first=True)  # fmt: skip

    no_group, other = records
    assert no_group["level"] == "WARN" and "exception" not in no_group
    assert no_group["message"].startswith("AllreduceException: Averaging step failed: could not find a group")
    assert other["level"] == "ERROR" and "KeyError: 'another failure'" in other["exception"]
    assert stderr.count("Traceback") == 1
