"""What every benchmark result carries (the command, the machine, versions and the date), and what the lab benchmarks
share: a peer's metrics records, waiting for peers to finish, stopping them."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    import numpy
    import torch

    import dilocox_p2p

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hivemind": _version("hivemind"),
            "numpy": numpy.__version__,
            "dilocox_p2p": dilocox_p2p.__version__,
        },
    }


def _version(package: str) -> str | None:
    """A package's version, or None where it is not installed (an in-process benchmark needs no swarm)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_result(name: str, payload: dict[str, Any], *, directory: Path = RESULTS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({**environment(), **payload}, indent=2) + "\n")
    return path


def run_variants(args: Any, variants: dict[str, Any], run: Any, *, prefix: str) -> int:
    """Run `run(variant, tmp_dir)` for each of `variants` (name -> variant), one after the other, each in a fresh
    temporary directory; write the runs with the command and `args` to results/`args.name`.json (under `args.out`)
    and print them. The exit code of a benchmark's main()."""
    import tempfile

    result = {}
    for name, variant in variants.items():
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            result[name] = run(variant, Path(tmp))
    path = write_result(args.name, {"command": " ".join(sys.argv), "args": vars(args) | {"out": str(args.out)},
                                    "runs": result}, directory=args.out)  # fmt: skip
    print(path)
    print(result)
    return 0


def records(run_dir: Path) -> list[dict]:
    """A peer's metrics.jsonl records so far (none before its first)."""
    from dilocox_p2p.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def wait_all(procs: Any, timeout: float) -> None:
    """Wait until every process of `procs` (a dict of Popen) exited, or `timeout` seconds passed."""
    import time

    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(1.0)


def stop_all(procs: Any, timeout: float = 120) -> None:
    """SIGTERM every process of `procs` (a dict of Popen) still running, wait for each, SIGKILL what will not stop."""
    import signal
    import subprocess

    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
