"""Fixtures for the swarm tier: real peers on loopback, always cleaned up."""

from __future__ import annotations

import itertools

import pytest

from tests.helpers.peers import Swarm

_ids = itertools.count()


@pytest.fixture
def swarm(tmp_path, request):
    s = Swarm(tmp_path, run_id=f"t{next(_ids)}-{request.node.name[:20].replace('[', '-').replace(']', '')}")
    yield s
    s.stop_all()
