"""Docker containers, volumes and a network for the docker tier, labelled so that all are removed."""

from __future__ import annotations

import subprocess
import uuid


class Containers:
    """Containers, volumes and one user-defined network of a test, all labelled, all removed by `remove_all`."""

    def __init__(self) -> None:
        self.label = f"dilocox-test={uuid.uuid4().hex[:10]}"
        self.prefix = f"dlx{self.label[-6:]}"
        self.network = f"{self.prefix}-net"
        self.names: list[str] = []
        self.volumes: list[str] = []
        docker("network", "create", "--label", self.label, self.network)

    def run(self, name: str, image: str, *args: str, volume: str | None = None, net_admin: bool = False) -> str:
        full = f"{self.prefix}-{name}"
        opts = ["--name", full, "--hostname", full, "--network", self.network, "--label", self.label]
        if volume:
            vol = f"{self.prefix}-{volume}"
            if vol not in self.volumes:
                docker("volume", "create", "--label", self.label, vol)
                self.volumes.append(vol)
            opts += ["-v", f"{vol}:/data"]
        if net_admin:
            opts += ["--cap-add", "NET_ADMIN"]
        docker("run", "-d", *opts, image, *args)
        self.names.append(full)
        return full

    def remove_all(self) -> None:
        ids = docker("ps", "-aq", "--filter", f"label={self.label}", check=False).split()
        if ids:
            docker("rm", "-f", "-v", *ids, check=False)
        for vol in self.volumes:
            docker("volume", "rm", "-f", vol, check=False)
        docker("network", "rm", self.network, check=False)


def docker(*args: str, check: bool = True, timeout: float = 120) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])}... failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result.stdout
