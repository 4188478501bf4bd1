"""Why a request of this worker to a leader ended without a group, in hivemind's words.

hivemind's `Matchmaking._request_join_group` says why a request ended empty (the leader's refusal code, an
error of the stream, a leader that did not answer in time, a disbanded group) at debug level only, and our
peers log hivemind at warning. A worker that a leader counted into a group after its request had ended
("no group after 0.02 s", CI run 180) then left no trace of what ended it. `capture` keeps those debug lines
of the request's task, without printing them, and `take` hands the last one to the line that reports the
request (matchmaking.track_join_requests); a request cancelled by its search is told apart there.
"""

from __future__ import annotations

import asyncio
import logging

__all__ = ["capture", "take"]

_SOURCE = "hivemind.averaging.matchmaking"
_FUNCTION = "_request_join_group"
_reasons: dict[asyncio.Task, str] = {}


class _Capture(logging.Filter):
    """Keeps the debug records of `_request_join_group` by task (dropped from the log); passes everything else
    at the level the rest of hivemind logs at."""

    def __init__(self, passed_level: int):
        super().__init__()
        self.passed_level = passed_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.passed_level:
            return True
        if record.funcName == _FUNCTION:
            try:
                task = asyncio.current_task()
            except RuntimeError:
                task = None
            if task is not None:
                why = record.getMessage()
                if record.exc_info and record.exc_info[1] is not None:
                    why += f" {record.exc_info[1]!r}"
                _reasons[task] = why
        return False


def capture() -> None:
    """Keep hivemind's reasons from now on in this process (once; the averager process calls it)."""
    source = logging.getLogger(_SOURCE)
    if any(isinstance(f, _Capture) for f in source.filters):
        return
    passed = source.getEffectiveLevel()
    source.addFilter(_Capture(passed))
    source.setLevel(min(passed, logging.DEBUG))


def take() -> str:
    """hivemind's last reason in the running task's request ("" if it said none), forgotten once taken."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return ""
    return _reasons.pop(task, "") if task is not None else ""
