"""Fault injection for tests: crash a peer at a precise point of the protocol.

Armed through the environment of the peer's processes, e.g.

    DILOCOX_FAULTS="kill_peer_in_allreduce:round=2:stage=0"

kills every process of the peer (its whole process group, as a power cut would) when
stage 0's averager receives the first tensor part of round 2's all-reduce. Unset in
normal runs; nothing here runs unless a fault is armed.
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["armed", "kill_peer"]

logger = logging.getLogger(__name__)
ENV = "DILOCOX_FAULTS"


def _parse(text: str) -> list[tuple[str, dict[str, str]]]:
    plans = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, *pairs = item.split(":")
        plans.append((name, dict(pair.split("=", 1) for pair in pairs)))
    return plans


def armed(name: str, **context: object) -> bool:
    """True if a fault `name` is armed whose conditions all match `context`."""
    text = os.environ.get(ENV, "")
    if not text:
        return False
    return any(n == name and all(str(context.get(k)) == v for k, v in cond.items()) for n, cond in _parse(text))


def kill_peer(reason: str) -> None:
    """SIGKILL the whole process group of this peer."""
    logger.error("fault injection: killing the peer (%s)", reason)
    os.killpg(os.getpgid(0), signal.SIGKILL)
