"""The netns tier needs root and iproute2. Without them it is skipped with the reason, so that
`pytest` passes for a user who is not root; under CI=true it fails instead, loudly."""

from __future__ import annotations

import os

import pytest

from benchmarks.netlab import NetLabError, check_available


@pytest.fixture(autouse=True)
def _network_namespaces_available() -> None:
    try:
        check_available()
    except NetLabError as e:
        if os.environ.get("CI"):
            pytest.fail(f"the netns tier cannot run in CI: {e}")
        pytest.skip(f"netns tier: {e} (under CI=true this fails instead)")
