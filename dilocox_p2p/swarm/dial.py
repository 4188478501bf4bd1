"""A peer that could not be dialed is asked again until the request's deadline.

libp2p refuses to dial a peer again for a few seconds after a dial failed ("dial backoff", 5 s
at first in go-libp2p). One dial that fails under load (a security handshake past the local
dial timeout on a starved machine) would otherwise fail every request to that peer for the
rest of a round: a member's message "not received", an average nobody could fetch, a group
split in two (CI saw a topk round end that way). Requests that could not reach their peer are
repeated every DIAL_RETRY_S until their deadline; a refusal or a timeout of a reached peer is
not repeated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["redial", "unreachable"]

logger = logging.getLogger(__name__)

DIAL_RETRY_S = 1.0
_UNREACHABLE = ("failed to dial", "dial backoff", "Connect failed", "no addresses")

T = TypeVar("T", bound=tuple)


def unreachable(reason: str) -> bool:
    """Whether a request failed because its peer could not be dialed (not because the peer answered)."""
    return any(marker in reason for marker in _UNREACHABLE)


async def redial(call: Callable[[], Awaitable[T]], deadline: float, *, what: str) -> T:
    """`call()` (a result tuple whose second item is the failure reason, "" on success), repeated while its
    peer cannot be dialed and `deadline` (time.monotonic()) allows."""
    result = await call()
    tries = 1
    while unreachable(str(result[1])) and deadline - time.monotonic() > DIAL_RETRY_S:
        if tries == 1:
            logger.info("%s: the peer could not be dialed (%s); asking again until the deadline", what,
                        str(result[1])[:120])  # fmt: skip
        await asyncio.sleep(DIAL_RETRY_S)
        result = await call()
        tries += 1
    return result
