"""One run of one variant: N peers in their own network namespaces, interface counters sampled throughout.

    run = run_peers(cmds, rate_mbit=3.8, run_dirs=dirs, announces=True, timeout=600)
    run.records[host]   # that peer's metrics.jsonl
    run.wire(host, t0, t1)   # (rx, tx) bytes its eth0 moved between two unix times

Peer 0 starts first; where `announces`, the others join through the multiaddr it writes to its run dir
(`wait_for_multiaddrs`, as benchmarks/modes.py does). The lab (namespaces, links, every process started
in them) is removed on the way out, also on an error or a signal.
"""

from __future__ import annotations

import bisect
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.netlab import NetLab
from dilocox_p2p.launch import wait_for_multiaddrs
from dilocox_p2p.metrics import read_metrics

__all__ = ["GLOO_ON_LAB_LINK", "PeerRun", "ROOT", "run_peers"]

ROOT = Path(__file__).resolve().parents[2]
GLOO_ON_LAB_LINK = {"GLOO_SOCKET_IFNAME": "eth0"}  # gloo across namespaces: its pairs must use the shaped link
SAMPLE_S = 0.25


@dataclass
class PeerRun:
    records: list[list[dict]]
    samples: list[tuple[float, list[tuple[int, int]]]] = field(default_factory=list)
    """(unix time, [(rx, tx) per host]) every SAMPLE_S seconds while the peers ran."""
    seconds: float = 0.0
    """Wall time from the first peer's start to the last one's exit (start-up included)."""

    def wire(self, host: int, t0: float, t1: float) -> tuple[int, int]:
        """(rx, tx) bytes host's eth0 moved between unix times t0 and t1 (nearest samples at or before each)."""
        times = [t for t, _ in self.samples]
        a = self.samples[max(0, bisect.bisect_right(times, t0) - 1)][1][host]
        b = self.samples[max(0, bisect.bisect_right(times, t1) - 1)][1][host]
        return b[0] - a[0], b[1] - a[1]


class _Sampler:
    """Polls every host's counters (sysfs reads, no process) until stopped; bounded by the run's own timeout."""

    def __init__(self, lab: NetLab):
        self.lab, self.samples = lab, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="counters", daemon=True)

    def _take(self) -> None:
        self.samples.append((time.time(), [self.lab.counters(h) for h in range(self.lab.n_hosts)]))

    def __enter__(self) -> _Sampler:
        self._take()
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._take()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


def run_peers(
    cmd: Callable[[NetLab, int], list[str]],
    *,
    peers: int,
    rate_mbit: float | None,
    run_dirs: list[Path],
    announces: bool,
    timeout: float,
    env: dict[str, str] | None = None,
) -> PeerRun:
    """Start `cmd(lab, host)` for every host, wait (at most `timeout` s in all) for every one to exit 0.
    `run_dirs` must be absolute (the peers run from the repository root); `env` is added to theirs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    started = time.monotonic()
    with NetLab(peers, rate_mbit) as lab, _Sampler(lab) as sampler:
        procs: list[subprocess.Popen] = []
        for host, run_dir in enumerate(run_dirs):
            run_dir.mkdir(parents=True, exist_ok=True)
            argv = cmd(lab, host)
            if host > 0 and announces:
                argv += ["--initial-peers", wait_for_multiaddrs(run_dirs[0], alive=lambda: procs[0].poll() is None)[0]]
            log = open(_log_path(run_dir), "w")
            procs.append(lab.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env))
        for host, proc in enumerate(procs):
            left = max(1.0, timeout - (time.monotonic() - started))
            try:
                code = proc.wait(left)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                why = "timed out" if code is None else f"exited with {code}"
                raise SystemExit(f"peer {host} {why}; its log ({_log_path(run_dirs[host])}):\n"
                                 f"{_log_path(run_dirs[host]).read_text()[-3000:]}")  # fmt: skip
    return PeerRun(
        records=[read_metrics(d / "metrics.jsonl") for d in run_dirs],
        samples=sampler.samples,
        seconds=time.monotonic() - started,
    )


def _log_path(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}.out"
