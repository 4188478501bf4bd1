"""Who closes a p2p stream: the caller, once it has the handler's last message, never the handler first.

The p2p daemon (go-libp2p-daemon's doStreamPipe) answers the close of a handler's socket with Close() of the libp2p
stream, CloseRead then CloseWrite; CloseRead wakes the daemon's other goroutine, whose read then fails, and which
calls Reset(). When it does so before CloseWrite, the stream is reset instead of closed, and the caller's daemon
drops what it had received but not yet handed to the caller (yamux's Read on a reset stream). A race of two
goroutines, lost under load:
- a member of the fp32 butterfly saw a clean end after 21 (or 22, 27, 18) of a reducer's averaged parts while the
  reducer had sent all of them, mended the rest, and the round was recorded `mended`, not `averaged` (CI run 201;
  2 of 5 runs of 3 x 30 rounds of two peers beside a busy core: allreduce.py);
- a follower saw its leader's join stream end with no answer at all ("no group after 0.02 s ... StopAsyncIteration")
  while the leader had counted it in, found no group, and borrowed the round (CI run 204: group_admission.py).

So a handler whose caller closes the stream by itself once it has the last message keeps the stream open until
then (`leave_close_to_caller`); hivemind's stream handler cancels that wait when the caller's close arrives. A
caller that closes first has all it asked for, whatever its daemon does then.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["CLOSE_LINGER_S", "leave_close_to_caller"]

CLOSE_LINGER_S = 10.0
"""How long a handler keeps a stream open after its last message, for the caller to close it first."""


async def leave_close_to_caller(log: logging.Logger, caller: Any, stream: str, after: str) -> None:
    """Wait (in a stream handler, after its last message) until `caller` closes `stream`, at most CLOSE_LINGER_S;
    say on `log` which side closed it (DEBUG: the caller, "`caller` closed its `stream` after `after`"; INFO: this
    side, once the wait ran out)."""
    try:
        await asyncio.sleep(CLOSE_LINGER_S)
    except asyncio.CancelledError:
        log.debug("%s closed its %s after %s", caller, stream, after)
        raise
    log.info("%s kept its %s open %.0f s after %s: closed here", caller, stream, CLOSE_LINGER_S, after)
