"""Fault injection for tests: break a peer at a precise point of the protocol.

Armed through the environment of the peer's processes, several separated by `;`:

    DILOCOX_FAULTS="kill_peer_in_allreduce:round=2:stage=0"

- `kill_peer_in_allreduce:round=R:stage=S` kills every process of the peer (its whole
  process group, as a power cut would) when stage S's averager receives the first tensor
  part of round R's all-reduce.
- `withhold_average:round=R:stage=S` makes stage S's reducer keep the averaged parts of round
  R from the member after it in the group's order (it still counts that member's data):
  that member sees this reducer fail, the others do not, an asymmetric failure.
- `corrupt_state:round=R:stage=S` flips the lowest bit of theta_g's first value on stage S
  right after round R's outer step, as a memory error or a buggy peer would.
- `nan_pseudo_gradient:round=R:stage=S` puts a NaN into stage S's pseudo-gradient of round R,
  as a diverged or broken peer would produce.

Unset in normal runs; nothing here runs unless a fault is armed.
"""

from __future__ import annotations

import logging
import os
import signal

__all__ = ["KNOWN", "armed", "kill_peer"]

logger = logging.getLogger(__name__)
ENV = "DILOCOX_FAULTS"
KNOWN = ("kill_peer_in_allreduce", "withhold_average", "corrupt_state", "nan_pseudo_gradient")


def _parse(text: str) -> list[tuple[str, dict[str, str]]]:
    plans = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, *pairs = item.split(":")
        if name not in KNOWN:
            raise ValueError(f"{ENV}: unknown fault {name!r}; known: {', '.join(KNOWN)}")
        plans.append((name, dict(pair.split("=", 1) for pair in pairs)))
    return plans


def armed(name: str, **context: object) -> bool:
    """True if a fault `name` is armed whose conditions all match `context`."""
    text = os.environ.get(ENV, "")
    if not text:
        return False
    hit = any(n == name and all(str(context.get(k)) == v for k, v in cond.items()) for n, cond in _parse(text))
    if hit:
        logger.warning("fault injection: %s (%s)", name, ", ".join(f"{k}={v}" for k, v in context.items()))
    return hit


def kill_peer(reason: str) -> None:
    """SIGKILL the whole process group of this peer."""
    logger.error("fault injection: killing the peer (%s)", reason)
    os.killpg(os.getpgid(0), signal.SIGKILL)
