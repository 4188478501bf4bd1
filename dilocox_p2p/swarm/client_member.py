"""Client members: workers the swarm cannot dial average all the same, over connections they open themselves.

A volunteer behind a home router (NAT, no forwarded port) can open connections to the others but
nobody can open one to it. Two such workers in one group cannot exchange at all, and as a reducer
of the butterfly one needs every member's part. So a worker that the dial-back finds unreachable
(swarm.reachability = auto; `client` forces it) averages as a **client member**:

- its group ticket says so (signed): every member of the group then cuts the message into one span
  per *other* member (the reducers, in group order), fp32 as compressed (group_round.py,
  gather._scatter); the client sends its parts and takes the reduced parts, and reduces nothing;
- it never leads: hivemind's client mode of matchmaking (no declaration; a join request to it is
  refused) and the stage worker names no client member as the round's leader (MemberRecord.client);
- it opens a connection to every member it may group with as a round begins (`reach_members`), and
  again to the reducers once the group formed: libp2p carries streams both ways over a connection,
  so the reducers pull its parts over the connection it opened; two client members never need
  each other (their messages of an all-gather come relayed: gather.py);
- members that mend or borrow an average ask client members last (exchange.py).

Every member holds the same bits as ever: the reducers' reduced parts are what every member applies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from typing import Any

from hivemind.p2p import PeerID

__all__ = ["REACH_S", "reach_members", "reducers_of"]

logger = logging.getLogger(__name__)

REACH_S = 3.0  # a member that does not answer within this is not waited for (the round's pulls redial it)
_reaching: set[asyncio.Task] = set()  # asyncio holds tasks weakly


def reducers_of(group: Sequence[str], clients: Collection[str]) -> list[str]:
    """The members of `group` that reduce a span, in group order: all but its client members."""
    return [p for p in group if p not in clients]


def reach_members(p2p: Any, peers: Sequence[PeerID]) -> None:
    """Open (or keep) a connection from this worker to each of `peers`, in the background of the running event
    loop: a Hello to each (hello.py; any answer, or none, will do: the connection is what counts)."""
    for peer in peers:
        task = asyncio.ensure_future(_reach(p2p, peer))
        _reaching.add(task)
        task.add_done_callback(_reaching.discard)


async def _reach(p2p: Any, peer: PeerID) -> None:
    from .hello import say_hello  # hello.py serves the dial-back too, which imports the doctor's checks

    try:
        await say_hello(p2p, peer, timeout=REACH_S)
    except Exception as e:  # noqa: BLE001 - gone, or slow: the pulls of the round find out
        logger.debug("a client member could not reach %s: %r", peer, e)
