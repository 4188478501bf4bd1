"""The docker tier: images built by docker/build.sh, containers on their own network, always removed.

Without a working dockerd the tier is skipped with the reason, so that `pytest` passes for a user
without docker; under CI=true it fails instead, loudly (`.ci/run` installs and starts dockerd).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.containers import Containers, docker

ROOT = Path(__file__).resolve().parents[2]
TAG = os.environ.get("TAG", "dev")
BUILD_TIMEOUT_S = 1500


def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI (install docker.io, or run docker/ensure-docker.sh as root)"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"dockerd is not reachable ({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'docker info failed'})"
    return None


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    problem = _docker_problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"the docker tier cannot run in CI: {problem}")
        pytest.skip(f"docker tier: {problem} (under CI=true this fails instead)")
    build = subprocess.run(["bash", str(ROOT / "docker" / "build.sh")], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S, env={**os.environ, "TAG": TAG})  # fmt: skip
    assert build.returncode == 0, f"docker/build.sh failed:\n{build.stderr[-5000:]}"
    return {"peer": f"dilocox-p2p/peer:{TAG}", "bootstrap": f"dilocox-p2p/bootstrap:{TAG}"}


@pytest.fixture
def containers(images):
    c = Containers()
    try:
        yield c
    finally:
        c.remove_all()
        left = docker("ps", "-aq", "--filter", f"label={c.label}", check=False).split()
        assert not left, f"containers left behind: {left}"
