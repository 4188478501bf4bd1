"""A stage's state taken in pieces from several donors at once, each piece checked on arrival.

Every joiner used to take the whole state from the same donor (the first holder of the majority hash: the most
advanced), as hivemind's own state sharing does (hivemind#169): four joiners arriving at once cost that donor
four states while the others served nothing. Here a joiner asks each donor that announced the majority hash
for some of the state's pieces (state.piece_ranges, STATE_PIECE), all at once: piece k first from donor
(k + s) mod D, where s comes from the joiner's own peer id, so that joiners arriving together start on
different donors; a piece asked again goes to the donor with the fewest pieces so far (the next one in
that order handed every piece of a dropped donor to one donor: half of all bytes in the test). Each reply's
signed header lists the digests of every piece: the list must hash to the majority's state hash
(state.digest_of_pieces), and the piece's bytes to its digest in the list, before the piece is kept. A donor that fails either check, serves a piece late or not at all, or refuses, is asked for
nothing more: its pieces go to the next donor. Late: once some pieces are in, a piece still coming after
SLOW_FACTOR times the slowest of those (and at least MIN_LATE_S) is asked of one more donor too, and the
donor that the faster one beat is asked for nothing more (waiting out a chunk timeout instead, the other donors
had moved on, and kept the state one round only: the whole download failed, in the test of a stalled donor).
Donors that move past the boundary while a joiner downloads it say where they are (STATE_GONE); once as many have
moved on as are still asked (two or more), the download is given up and asked again at their boundary, where they
all serve (`leave_for_newer`, once per state taken: Agreement): finishing from the last donor left put a whole state
on it. The pending average is never in a piece: the state follows it
(`StageState.follows`), and the taker gets it apart (Agreement.fetch_pending) from the donor of the first
piece, which owes it (state_service._owe_pending), or from the others.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture

from ..errors import WireRejected
from ..state import StageState, digest_of_pieces, piece_ranges, tensors_digest
from ..wire import swarm_pb2
from .state_service import StateDownload
from .transfer import Oversized, same_shapes

__all__ = ["SLOW_FACTOR", "StatePieces", "checked_piece"]

SLOW_FACTOR = 2.0  # a piece slower than this many times the slowest piece in so far is asked of another donor too
MIN_LATE_S = 1.0  # ... and than this: the donors' rounds move on meanwhile, and each keeps a state one round past
POLL_S = 0.1


class _Piece:
    """One piece as a donor served it, checked."""

    def __init__(self, donor: str, tensors: list[torch.Tensor], header: swarm_pb2.StateHeader, size: int) -> None:
        self.donor, self.tensors, self.header, self.size = donor, tensors, header, size


class StatePieces:
    """Mixin for DilocoxAverager: `download_pieces` (stage side) runs `_download_pieces` in the averager process."""

    _averaged_tensors: Sequence[torch.Tensor]
    peer_id: PeerID

    def download_pieces(
        self, donors: Sequence[str], boundary: int, *, want_hash: str, wait_s: float, timeout: float,
        leave_for_newer: bool = False,
    ) -> StateDownload:  # fmt: skip
        """The state of `boundary` (theta_g and momentum; its pending average follows), in pieces from `donors`
        (holders of the majority hash `want_hash`), each checked against that hash. `leave_for_newer`: give it up
        (STATE_GONE, at the newest boundary they told) once as many donors moved past it as are left (module
        docstring)."""
        kwargs = dict(donors=list(donors), boundary=boundary, want_hash=want_hash, wait_s=wait_s, timeout=timeout,
                      leave_for_newer=leave_for_newer)  # fmt: skip
        return self._call("_download_pieces", timeout + wait_s + 30.0, **kwargs)  # type: ignore[attr-defined]

    async def _download_pieces(
        self, donors: list[str], boundary: int, want_hash: str, wait_s: float, timeout: float, leave_for_newer: bool,
        future: MPFuture,
    ) -> None:  # fmt: skip
        started = time.monotonic()
        try:  # as long as one donor's whole state may take: a piece asked of every donor in turn must not take D times
            taking = self._take_pieces(donors, boundary, want_hash, wait_s, timeout, leave_for_newer)
            got = await asyncio.wait_for(taking, timeout + wait_s)
            got.seconds = time.monotonic() - started
            future.set_result(got)
        except asyncio.TimeoutError:
            future.set_result(StateDownload(status=-1, boundary=boundary, donor="",
                                            reason=f"not every piece came within {timeout + wait_s:.0f} s"))  # fmt: skip
        except Exception as e:  # a bug must not leave the stage waiting for its whole timeout
            if not future.done():
                future.set_result(StateDownload(status=-1, boundary=-1, donor="", reason=repr(e)[:200]))

    async def _take_pieces(
        self, donors: list[str], boundary: int, want_hash: str, wait_s: float, timeout: float, leave_for_newer: bool = False
    ) -> StateDownload:
        like = [*self._averaged_tensors, *self._averaged_tensors]  # theta_g, then momentum
        ranges = piece_ranges([t.numel() * t.element_size() for t in like])
        start = int.from_bytes(hashlib.sha256(self.peer_id.to_bytes()).digest()[:4], "big") % len(donors)
        order = donors[start:] + donors[:start]
        dropped: dict[str, str] = {}
        moved: dict[str, int] = {}  # donors that moved past `boundary`: the boundary each said it is at
        pieces: dict[int, _Piece] = {}
        took: list[float] = []  # seconds each piece in so far took
        load = collections.Counter({d: 0 for d in order})  # pieces each donor was asked for

        def next_donor(k: int, tried: set[str]) -> str | None:
            left = [order[(k + j) % len(order)] for j in range(len(order))]
            left = [d for d in left if d not in dropped and d not in tried]
            return min(left, key=lambda d: load[d]) if tried and left else (left[0] if left else None)

        def most_moved() -> bool:
            """Two or more donors moved past `boundary`, as many as are still asked: finishing from the few left put
            a whole state on one donor (the lab test: 52% of four joiners' bytes); at theirs, all serve again."""
            return len(moved) >= 2 and len(moved) >= sum(d not in dropped for d in order)

        async def take(k: int) -> None:
            tried: set[str] = set()
            asking: dict[asyncio.Future, tuple[str, float]] = {}  # attempt -> (donor, when asked)

            def ask() -> bool:
                donor = next_donor(k, tried)
                if donor is not None:
                    tried.add(donor)
                    load[donor] += 1
                    attempt = self._take_piece(donor, boundary, k, ranges, like, want_hash, wait_s, timeout)
                    asking[asyncio.ensure_future(attempt)] = (donor, time.monotonic())
                return donor is not None

            try:
                while asking or ask():
                    done, _ = await asyncio.wait(asking, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    for attempt in done:
                        donor, asked = asking.pop(attempt)
                        got, why, at = attempt.result()
                        if got is None:
                            dropped.setdefault(donor, why)  # it is asked for no other piece
                            if at > boundary:
                                moved[donor] = at
                            if leave_for_newer and most_moved():
                                return  # no piece: the download ends, and is asked again at their boundary
                            continue
                        took.append(time.monotonic() - asked)
                        pieces[k] = got
                        for slow, (other, _) in asking.items():  # a hedge came first: the donor asked before it is slow
                            if asked > asking[slow][1]:
                                dropped.setdefault(other, f"slow: piece {k} came from {donor[-6:]}, asked later")
                        return
                    # hedged: once some pieces are in, a piece late by SLOW_FACTOR times the slowest of them is asked
                    # of one more donor, the first request left running (a slow donor may still come first)
                    late = max(SLOW_FACTOR * max(took, default=0.0), MIN_LATE_S)
                    now = time.monotonic()
                    if took and asking and all(now - t > late for _, t in asking.values()) and not ask():
                        # late, and no donor left to ask: the piece is given up (the download with it) rather than
                        # waited for (a stalled donor's piece, every other donor gone: 60 s in the lab test)
                        for other, _ in asking.values():
                            dropped.setdefault(other, f"slow: piece {k} not in after {late:.1f} s, and no other donor left")
                        return
            finally:
                for attempt in asking:
                    attempt.cancel()

        # a piece that no donor could serve dooms the download: the others' requests are not waited for (a stalled
        # donor's ran out its whole timeout while every other donor had moved on: the lab test, 65 s)
        pending = {asyncio.ensure_future(take(k)): k for k in range(len(ranges))}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(pending.pop(task) not in pieces for task in done):
                    break
        finally:
            for task in pending:
                task.cancel()
        served: collections.Counter[str] = collections.Counter()
        for p in pieces.values():
            served[p.donor] += p.size
        missing = [k for k in range(len(ranges)) if k not in pieces]
        if missing and leave_for_newer and most_moved():
            return StateDownload(status=swarm_pb2.STATE_GONE, boundary=max(moved.values()), donor="",
                                 bytes_by_donor=dict(served), dropped=dropped,
                                 reason=f"{len(moved)} of {len(order)} donors moved on (to round {max(moved.values())})")  # fmt: skip
        if missing:
            return StateDownload(status=-1, boundary=boundary, donor="", bytes_by_donor=dict(served), dropped=dropped,
                                 reason=f"pieces {missing} of {len(ranges)} could not be had from any donor")  # fmt: skip
        # each piece matched its digest in a list that makes want_hash: so do they, put together (the stage checks the
        # whole against the records again before it installs it: Agreement.verify)
        tensors = [t for k in range(len(ranges)) for t in pieces[k].tensors]
        n, first = len(self._averaged_tensors), pieces[0]
        follows = first.header.pending.round if first.header.pending_follows else -1
        state = StageState(boundary, tensors[:n], tensors[n:], None, follows=follows)
        return StateDownload(status=swarm_pb2.STATE_OK, boundary=boundary, donor=first.donor, state=state,
                             state_hash=want_hash, bytes_by_donor=dict(served), dropped=dropped)  # fmt: skip

    async def _take_piece(
        self, donor: str, boundary: int, k: int, ranges: list[tuple[int, int]], like: list[torch.Tensor],
        want_hash: str, wait_s: float, timeout: float,
    ) -> tuple[_Piece | None, str, int]:  # fmt: skip
        """Piece `k` from `donor`, checked, or why not; and the boundary the donor said it is at where it moved past
        `boundary` (its signed STATE_GONE; else -1)."""
        a, b = ranges[k]
        piece_bytes = sum(t.numel() * t.element_size() for t in like[a:b])
        try:
            header, reply = await self._ask_state(donor, boundary, wait_s, timeout, swarm_pb2.STATE_PIECE, piece=k,  # type: ignore[attr-defined]
                                                  max_bytes=int(piece_bytes * 1.02) + (1 << 20))  # fmt: skip
        except (WireRejected, Oversized) as e:
            return None, f"refused: {e}", -1
        except Exception as e:
            return None, repr(e)[:200], -1
        at = header.boundary if header.status == swarm_pb2.STATE_GONE else -1
        return (*checked_piece(donor, k, header, reply, like[a:b], len(ranges), want_hash), at)


def checked_piece(
    donor: str, k: int, header: swarm_pb2.StateHeader, reply: Any, like: list[torch.Tensor], n_pieces: int, want_hash: str
) -> tuple[_Piece | None, str]:
    """Piece `k` of a reply whose signed `header` was opened, if it is what the majority's state holds there; else why
    not (`like`: the piece's tensors as this stage holds them)."""
    if header.status != swarm_pb2.STATE_OK:
        return None, f"{swarm_pb2.StateStatus.Name(header.status)} (donor at {header.boundary}) {header.reason}"
    if header.has_pending or header.n_tensors != len(reply.tensors) or len(reply.tensors) != len(like):
        return None, (f"refused: piece {k} holds {len(reply.tensors)} tensors (its header says {header.n_tensors}"
                      f"{', and a pending average' if header.has_pending else ''}) where it has {len(like)}")
    if not same_shapes(reply.tensors, like):
        return None, "refused: the piece's tensors do not fit this stage"
    if reply.sha256 != header.sha256:
        return None, "refused: the tensor bytes do not match the signed header's SHA-256 (altered on the way)"
    digests = list(header.piece_digests)
    if len(digests) != n_pieces or digest_of_pieces(digests) != want_hash:
        return None, f"refused: its piece digests do not make the majority's state hash {want_hash[:12]}"
    if tensors_digest(reply.tensors) != digests[k]:
        return None, f"refused: piece {k} does not match its digest (the donor holds or serves another state)"
    return _Piece(donor, reply.tensors, header, reply.size), ""
