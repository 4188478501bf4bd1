"""Start-up timeline: when each phase of a peer's start ended, in RUN_DIR/startup.jsonl.

Every process of a peer marks the phases it goes through, once per life (a `--resume` starts
a new life, appended after the old one):

    launcher   process (its start, from the kernel), imports, preflight
    each stage stage_process, dht, model, corpus, joined, first_step, first_exchange, first_group

`first_exchange` is when this stage's first exchange began (its first round trained), and
`first_group` when its first exchange in a group of two or more ended. Phases
overlap: a stage's DHT node starts while its model is built and its corpus read, so a mark
says when a phase was done, and the chain of the lead stage's marks in time order is the
start-up's critical path (`phases`). The lead stage logs that path once, at its first inner
step. `benchmarks/startup.py` reads the same file.

One JSON object per line, written with a single O_APPEND write, so the stage processes can
mark concurrently:  {"phase": "model", "stage": 0, "pid": 4242, "time": 1764140000.123}
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["Timeline", "configure", "mark", "phases", "process_start_time", "read_lives"]

logger = logging.getLogger(__name__)

FILE = "startup.jsonl"
LAUNCHER_PHASES = ("process", "imports", "preflight")
STAGE_PHASES = ("stage_process", "dht", "model", "corpus", "joined", "first_step", "first_exchange", "first_group")


def process_start_time(pid: int | None = None) -> float:
    """When process `pid` (this one by default) started, as a Unix time (Linux: from /proc, to the
    clock tick); elsewhere, now."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class Timeline:
    """The marks of one process. Marks made before `attach` (the launcher's, while the run directory is
    not prepared yet) are held and written by it."""

    def __init__(self, stage: int | None = None):
        self.stage = stage
        self.path: Path | None = None
        self._held: list[dict[str, Any]] = []
        self._done: set[str] = set()

    def attach(self, run_dir: Path, *, fresh: bool = False) -> None:
        """Write to RUN_DIR/startup.jsonl from now on (`fresh`: a new run; the file starts empty)."""
        self.path = Path(run_dir) / FILE
        if fresh:
            self.path.unlink(missing_ok=True)
        held, self._held = self._held, []
        for entry in held:
            self._write(entry)

    def mark(self, phase: str, *, at: float | None = None) -> None:
        """`phase` ended now (or at `at`); a phase already marked in this life is ignored."""
        if phase in self._done:
            return
        self._done.add(phase)
        entry = {"phase": phase, "stage": self.stage, "pid": os.getpid(), "time": time.time() if at is None else at}
        if self.path is None:
            self._held.append(entry)
        else:
            self._write(entry)
        if phase == "first_step" and self.stage == 0 and self.path is not None:
            self._log_path()

    def _write(self, entry: dict[str, Any]) -> None:
        assert self.path is not None
        line = (json.dumps(entry) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:  # a timeline is never worth failing a run for
            logger.debug("could not write the start-up mark %s: %s", entry["phase"], e)

    def _log_path(self) -> None:
        lives = read_lives(self.path.parent) if self.path is not None else []
        if not lives:
            return
        path = phases(lives[-1])
        if path:
            total = sum(seconds for _, seconds in path)
            logger.info("started in %.1f s: %s", total, ", ".join(f"{name} {seconds:.1f}" for name, seconds in path))


_timeline = Timeline()


def configure(*, stage: int | None, run_dir: Path | None = None) -> Timeline:
    """This process's timeline from now on (a stage process calls it first thing)."""
    global _timeline
    _timeline = Timeline(stage)
    if run_dir is not None:
        _timeline.attach(run_dir)
    return _timeline


def timeline() -> Timeline:
    return _timeline


def mark(phase: str, *, at: float | None = None) -> None:
    """Mark `phase` on this process's timeline (see `configure`)."""
    _timeline.mark(phase, at=at)


def read_lives(run_dir: Path) -> list[list[dict[str, Any]]]:
    """The marks of RUN_DIR/startup.jsonl, one list per life of the peer (each begins at a `process` mark)."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    lives: list[list[dict[str, Any]]] = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill
        if entry.get("phase") == "process" or not lives:
            lives.append([])
        lives[-1].append(entry)
    return lives


def phases(life: list[dict[str, Any]], *, stage: int = 0, until: str = "first_step") -> list[tuple[str, float]]:
    """The critical path of one life up to `until` (or as far as it got): the launcher's marks, then
    `stage`'s, in time order, as (phase, seconds since the mark before). Empty without a `process` mark."""
    ours = [e for e in life if e["stage"] is None or e["stage"] == stage]
    ours.sort(key=lambda e: e["time"])
    if not ours or ours[0]["phase"] != "process":
        return []
    out: list[tuple[str, float]] = []
    last = ours[0]["time"]
    for entry in ours[1:]:
        out.append((entry["phase"], max(0.0, entry["time"] - last)))
        last = max(last, entry["time"])
        if entry["phase"] == until:
            break
    return out
