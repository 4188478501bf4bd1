"""A peer that could not be dialed is asked again until the request's deadline.

libp2p refuses to dial a peer again for a few seconds after a dial failed ("dial backoff", 5 s
at first in go-libp2p). One dial that fails under load (a security handshake past the local
dial timeout on a starved machine) would otherwise fail every request to that peer for the
rest of a round: a member's message "not received", an average nobody could fetch, a group
split in two (CI saw a topk round end that way). Requests that could not reach their peer are
repeated every DIAL_RETRY_S for REDIAL_WINDOW_S (one backoff and a margin) within their deadline;
a refused connection (nothing listens: the peer is gone), a refusal or a timeout of a reached
peer are not repeated. A member that died costs a round at most that window.
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
REDIAL_WINDOW_S = 6.0
_UNREACHABLE = ("failed to dial", "dial backoff", "Connect failed", "no addresses")

T = TypeVar("T", bound=tuple)


def unreachable(reason: str) -> bool:
    """Whether a request failed because its peer could not be dialed for now (not because the peer answered,
    nor because nothing listens at its address)."""
    return any(marker in reason for marker in _UNREACHABLE) and "connection refused" not in reason


async def redial(
    call: Callable[[], Awaitable[T]],
    deadline: float,
    *,
    what: str,
    retry_s: float = DIAL_RETRY_S,
    window_s: float = REDIAL_WINDOW_S,
) -> T:
    """`call()` (a result tuple whose second item is the failure reason, "" on success), repeated every `retry_s`
    while its peer cannot be dialed, for at most `window_s` and until `deadline` (time.monotonic())."""
    result = await call()
    tries, until = 1, min(deadline, time.monotonic() + window_s)
    while unreachable(str(result[1])) and until - time.monotonic() > retry_s:
        if tries == 1:
            logger.info("%s: the peer could not be dialed (%s); asking again for a few seconds", what,
                        str(result[1])[:120])  # fmt: skip
        await asyncio.sleep(retry_s)
        result = await call()
        tries += 1
    return result
