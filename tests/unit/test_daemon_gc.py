"""The p2p daemon's garbage collector settings: join's defaults, and an operator's own values kept."""

from __future__ import annotations

import pytest

from dilocox_p2p.swarm.daemon_gc import DAEMON_GOGC, DAEMON_GOMEMLIMIT, tune_daemon_gc

pytestmark = pytest.mark.unit


def test_a_daemon_started_without_go_settings_collects_at_4x_its_live_heap_under_a_memory_cap():
    environ: dict[str, str] = {"PATH": "/bin"}
    tune_daemon_gc(environ)
    assert environ == {"PATH": "/bin", "GOGC": DAEMON_GOGC, "GOMEMLIMIT": DAEMON_GOMEMLIMIT}


def test_an_operators_own_gogc_and_memory_limit_are_kept():
    environ = {"GOGC": "50"}
    tune_daemon_gc(environ)
    assert environ == {"GOGC": "50", "GOMEMLIMIT": DAEMON_GOMEMLIMIT}
    environ = {"GOMEMLIMIT": "2GiB"}
    tune_daemon_gc(environ)
    assert environ == {"GOGC": DAEMON_GOGC, "GOMEMLIMIT": "2GiB"}
