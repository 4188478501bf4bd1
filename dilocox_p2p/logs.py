"""Logging set-up for the processes dilocox-p2p starts (CLI, launcher, stage workers)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

__all__ = ["init_logging"]

_FORMAT = "%(asctime)s %(levelname)s %(prefix)s%(name)s: %(message)s"


class _PrefixFilter(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        record.prefix = self.prefix
        return True


def init_logging(level: str = "info", *, prefix: str = "", file: Path | None = None) -> None:
    """Log to stderr (and optionally a file) with a prefix such as `[stage 1] `.

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
    for handler in handlers:
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler.addFilter(_PrefixFilter(prefix))
        root.addHandler(handler)
    root.setLevel(level)
    noisy = "DEBUG" if level == "DEBUG" else "WARNING"
    for name in ("hivemind", "matplotlib", "PIL", "torch.distributed.pipelining"):
        logging.getLogger(name).setLevel(noisy)
