"""A failed swarm test's digest explains it in the few lines CI shows (tests/helpers/artifacts.py).

    pytest tests/unit/test_artifacts.py -q
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.artifacts import digest, rounds_summary, shortened

pytestmark = pytest.mark.unit


def _record(t: int, kind: str, group: int, **faults: int) -> str:
    return json.dumps({"round": t, "kinds": [kind], "group_sizes": [group], "faults": {"repairs": 0, **faults}})


def test_rounds_alike_are_one_line_and_a_fault_or_a_gap_starts_another(tmp_path):
    lines = [_record(0, "alone", 1), *(_record(t, "averaged", 3) for t in range(1, 6)), _record(6, "averaged", 3, repairs=1),
             _record(7, "averaged", 3), _record(9, "averaged", 3), "{torn"]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert rounds_summary(tmp_path / "metrics.jsonl") == [
        "  round 0: ['alone'] groups [1]",
        "  rounds 1-5: ['averaged'] groups [3]",
        "  round 6: ['averaged'] groups [3] faults {'repairs': 1}",
        "  round 7: ['averaged'] groups [3]",
        "  round 9: ['averaged'] groups [3]",
    ]


def test_the_digest_ends_with_each_peers_rounds_after_the_warnings_and_split_rounds_of_its_logs(tmp_path):
    peer = tmp_path / "peer0"
    (peer / "logs").mkdir(parents=True)
    (peer / "logs" / "stage0.log").write_text(
        "10:00 INFO started\n10:01 WARN lost a route\n"
        "10:01 INFO asked ..x to take this worker into its group: no group after 4.10 s\n10:02 INFO round 1\n"
    )
    (peer / "metrics.jsonl").write_text(_record(0, "averaged", 2) + "\n")
    text = digest(tmp_path).splitlines()
    assert "10:01 WARN lost a route" in text[:3]
    assert "10:01 INFO asked ..x to take this worker into its group: no group after 4.10 s" in text[:3]
    assert text[-2:] == ["--- round records of peer0", "  round 0: ['averaged'] groups [2]"]


def test_log_lines_lose_their_date_full_peer_ids_and_package_prefix_in_the_digest():
    line = ("2026-11-26 23:58:25 WARN [peer ..HWcM8y stage 0] dilocox_p2p.swarm.faults: state of round 21 not taken "
            "from 12D3KooWHXdirZQfz9fvq3TRKje2SvaPgEPF1jMDDdP4rSuzNmjV: STATE_GONE (donor at 22)  [downloads_failed]")
    assert shortened(line) == ("23:58:25 WARN [peer ..HWcM8y stage 0] swarm.faults: state of round 21 not taken "
                               "from ..uzNmjV: STATE_GONE (donor at 22)  [downloads_failed]")
