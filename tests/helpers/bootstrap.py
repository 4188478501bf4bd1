"""A real `dilocox-bootstrap` process for the swarm tier, and the small socket helpers its tests share."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.peers import kill_session
from tests.helpers.ports import free_port  # noqa: F401  (tests import it from here)


class Bootstrap:
    """A real `dilocox-bootstrap` process in its own session (killed with its DHT and p2pd if a test fails)."""

    def __init__(self, state_dir: Path, *args: str, env: dict[str, str] | None = None):
        self.state_dir = state_dir
        self.out, self.err = state_dir.parent / f"{state_dir.name}.out", state_dir.parent / f"{state_dir.name}.err"
        cmd = [sys.executable, "-m", "dilocox_p2p.cli.bootstrap", "--state-dir", str(state_dir), *args]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True,
                                         env={**os.environ, **(env or {})})  # fmt: skip

    def maddrs(self, timeout: float = 60.0) -> list[str]:
        """The multiaddrs it prints on stdout, one per line, once it serves."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.out.read_text().split()
            if lines:
                return lines
            assert self.proc.poll() is None, f"dilocox-bootstrap exited with {self.proc.returncode}:\n{self.log()}"
            time.sleep(0.1)
        raise AssertionError(f"dilocox-bootstrap printed no multiaddr in {timeout}s:\n{self.log()}")

    def health(self) -> str:
        return health_status((self.state_dir / "health.addr").read_text().strip())

    def stop(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"dilocox-bootstrap ignored SIGTERM for {timeout}s:\n{self.log()}") from None

    def kill(self) -> None:
        """SIGKILL whatever is left of its session (the DHT process and p2pd may outlive a crashed parent)."""
        kill_session(self.proc)

    def log(self) -> str:
        return self.err.read_text()[-4000:]


def health_status(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
