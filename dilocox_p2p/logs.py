"""Logging set-up for the processes dilocox-p2p starts (CLI, launcher, stage workers, bootstrap).

One line per event, each naming where it happened: the peer (its libp2p id, shortened in
text), the stage and the round. A stage worker fills these in as it learns them:

    init_logging("info", fmt="json", file=run_dir / "logs" / "stage0.log")
    set_log_context(stage=0)
    set_log_context(peer=peer_id)      # once its DHT node is up
    set_log_context(round=12)          # each round

text:  2026-11-25 13:02:11 INFO [peer ..k3Fq stage 0 round 12] dilocox_p2p.worker: resumed from round 12
json:  {"time": "2026-11-25T13:02:11.532Z", "level": "INFO", "peer": "12D3KooW...k3Fq", "stage": 0,
        "round": 12, "logger": "dilocox_p2p.worker", "message": "resumed from round 12"}
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["init_logging", "route_hivemind_logs", "set_log_context"]

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(where)s%(name)s: %(message)s"
_context: dict[str, Any] = {"peer": None, "stage": None, "round": None}


def set_log_context(**fields: Any) -> None:
    """Name the peer / stage / round that later log lines of this process belong to (None clears one)."""
    unknown = set(fields) - set(_context)
    assert not unknown, f"unknown log context fields {unknown}"
    _context.update(fields)


def _where() -> str:
    parts = []
    if _context["peer"]:
        parts.append(f"peer ..{str(_context['peer'])[-6:]}")
    for name in ("stage", "round"):
        if _context[name] is not None:
            parts.append(f"{name} {_context[name]}")
    return f"[{' '.join(parts)}] " if parts else ""


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.where = _where()
        for name, value in _context.items():
            setattr(record, f"ctx_{name}", value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, peer, stage, round, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        out: dict[str, Any] = {"time": stamp, "level": record.levelname}
        for name in _context:
            value = getattr(record, f"ctx_{name}", None)
            if value is not None:
                out[name] = value
        out.update(logger=record.name, message=record.getMessage())
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def init_logging(level: str = "info", *, fmt: str = "text", file: Path | None = None) -> None:
    """Log to stderr (and optionally a file) as text lines or JSON objects (`fmt`).

    DILOCOX_LOGLEVEL overrides `level`. hivemind's own loggers are kept at warning unless
    the level is debug, because they are chatty at info.
    """
    level = os.environ.get("DILOCOX_LOGLEVEL", level).upper()
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(file))
    formatter = JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT, datefmt="%Y-%m-%d %H:%M:%S")
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(_ContextFilter())
        root.addHandler(handler)
    root.setLevel(level)
    noisy = "DEBUG" if level == "DEBUG" else "WARNING"
    for name in ("hivemind", "matplotlib", "PIL"):
        logging.getLogger(name).setLevel(noisy)
    if "hivemind" in sys.modules:  # imported before (a peer forked from the tests' warm interpreter): route it now
        route_hivemind_logs()


class _StepFoundNoGroup(logging.Filter):
    """hivemind's averager logs a step that found no group as an error with its traceback (`logger.exception`):
    a peer alone for a round, or whose group formed without it, printed a whole traceback for an outcome the exchange
    reports itself, with its reason. Here it is one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and "could not find a group" in str(exc):
            record.msg, record.args = f"{type(exc).__name__}: {exc} (the round's outcome follows, with its reason)", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def route_hivemind_logs() -> None:
    """hivemind's log lines through this process's handlers: its own colored stderr handler, which hivemind installs
    on import and does not propagate from, kept them out of a stage's log file and out of JSON logs, without the
    peer, stage and round. Call it where hivemind is imported (idempotent; init_logging calls it when hivemind was
    imported first); processes forked afterwards (the DHT's, the averager's) inherit it."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")  # hivemind's loggers propagate to the root logger: ours
    debug = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    logging.getLogger("hivemind").setLevel(logging.DEBUG if debug else logging.WARNING)
    averager = logging.getLogger("hivemind.averaging.averager")
    if not any(isinstance(f, _StepFoundNoGroup) for f in averager.filters):
        averager.addFilter(_StepFoundNoGroup())
