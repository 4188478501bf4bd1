"""A peer that could not be dialed is asked again until the request's deadline.

libp2p refuses to dial a peer again for a few seconds after a dial failed ("dial backoff", 5 s
at first in go-libp2p). One dial that fails under load (a security handshake past the local
dial timeout on a starved machine) would otherwise fail every request to that peer for the
rest of a round: a member's message "not received", an average nobody could fetch, a group
split in two (CI saw a topk round end that way). Requests that could not reach their peer are
repeated every DIAL_RETRY_S for REDIAL_WINDOW_S (one backoff and a margin) within their deadline;
a refused connection (nothing listens: the peer is gone), a refusal or a timeout of a reached
peer are not repeated.

A peer in dial backoff may be gone, too: the dial that put it there found nothing listening (a
member killed in an all-reduce: the others' parts to it were refused, and every request for its
average then said "dial backoff"), and each survivor waited out the whole window for it, every
round it died in (10 s, in tests and in the churn soak). Before asking again, the addresses the
backoff names are probed with a plain TCP connection: when each refuses it, the peer is gone. An
address that cannot be probed (relayed, QUIC) or that does not answer at all keeps the window.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["gone", "redial", "unreachable"]

logger = logging.getLogger(__name__)

DIAL_RETRY_S = 1.0
REDIAL_WINDOW_S = 6.0
_UNREACHABLE = ("failed to dial", "dial backoff", "Connect failed", "no addresses")
PROBE_S = 0.5  # a TCP probe of a backed-off address that neither connects nor is refused within it proves nothing
_PLAIN_TCP = re.compile(r"/ip[46]/([^/]+)/tcp/(\d+)")

T = TypeVar("T", bound=tuple)


def unreachable(reason: str) -> bool:
    """Whether a request failed because its peer could not be dialed for now (not because the peer answered,
    nor because nothing listens at its address)."""
    return any(marker in reason for marker in _UNREACHABLE) and "connection refused" not in reason


async def gone(reason: str, *, probe_s: float = PROBE_S) -> bool:
    """Whether the peer of a failed dial (`reason`, go-libp2p's "* [MULTIADDR] why" per address) is gone:
    every address it names refused the connection, or is in dial backoff and refuses a plain TCP probe now
    (module docstring). An address that failed otherwise, or cannot be probed, may still reach it."""
    entries = [chunk.split("]", 1) for chunk in reason.split("* [")[1:]]
    if not entries or any(len(entry) != 2 for entry in entries):
        return False
    for maddr, why in entries:
        if "connection refused" in why:
            continue
        address = _PLAIN_TCP.fullmatch(maddr)
        if "dial backoff" not in why or address is None:
            return False
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(address[1], int(address[2])), timeout=probe_s)
        except ConnectionRefusedError:
            continue
        except (OSError, asyncio.TimeoutError, ValueError):
            return False
        writer.close()
        return False  # something listens there
    return True


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
    while unreachable(str(result[1])) and until - time.monotonic() > retry_s and not await gone(str(result[1])):
        if tries == 1:
            logger.info("%s: the peer could not be dialed (%s); asking again for a few seconds", what,
                        str(result[1])[:120])  # fmt: skip
        await asyncio.sleep(retry_s)
        result = await call()
        tries += 1
    return result
