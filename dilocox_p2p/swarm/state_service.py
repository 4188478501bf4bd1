"""The stage's state at a round boundary, served to a joining or repairing worker and downloaded from a donor.

`rpc_download_round` streams this worker's complete state at a boundary (theta_g, outer momentum and
the average still pending, read from the host process), waiting up to the request's `wait_s` for it
to be complete; a worker that moved on keeps the boundary a request waits for (`_kept_boundary`).
A request may ask for part of it (StatePart): theta_g and momentum at once, naming the average still
in flight instead of waiting for it (STATE_NOW), and later that average alone (STATE_PENDING), so
that a joiner trains its first round while the average it applies at the round's end arrives.
`_download_round` asks a donor for it and checks the reply (shapes, signed SHA-256) before anything
is used. A request may also ask for one piece of theta_g and momentum (STATE_PIECE, state.piece_ranges):
its header lists the digests of every piece, whose SHA-256 is the state hash, so that a joiner takes the
pieces from several donors at once and checks each on arrival (state_pieces.py). Runs in the averager
process (DilocoxAverager, averager.py); signed as transfer.py says.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, AsyncIterator  # typing's: hivemind reads rpc handlers' stream hints by their _name

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils import MPFuture

from .. import injection
from ..average import Average, AverageKind, malformed_average
from ..errors import WireRejected
from ..proto_gen import envelope_pb2
from ..state import PendingAverage, StageState, piece_digests, piece_ranges
from ..wire import swarm_pb2
from .transfer import Oversized, Reply, limit_per_peer, read_stream, same_shapes

__all__ = ["StateDownload", "StateProvider", "StateService"]

STALL_S = 60.0  # fault injection `stall_served_piece`: how long a request for a piece is held


@dataclass
class StateDownload:
    """A state received from a donor (status OK), or why not."""

    status: int
    boundary: int
    donor: str
    state: StageState | None = None
    state_hash: str = ""
    reason: str = ""
    bytes_by_donor: dict[str, int] = field(default_factory=dict)
    """The reply bytes each donor served (a state taken in pieces: several)."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Donors a download in pieces stopped asking, and why (state_pieces.py)."""
    seconds: float = 0.0
    """How long the download took."""


StateProvider = Callable[[int, bool], StageState | None]  # the state of a boundary, if held (complete, unless
# the flag allows one whose pending average is still in flight: StageState.follows)


class StateService:
    """The averager's (DilocoxAverager's) state serving and downloading."""

    @limit_per_peer(swarm_pb2.StateHeader)
    async def rpc_download_round(
        self, sealed: envelope_pb2.SignedEnvelope, context: P2PContext
    ) -> AsyncIterator[swarm_pb2.Chunk]:
        """Stream this worker's state at `request.boundary`, waiting up to `wait_s` for it to be complete."""
        header = swarm_pb2.StateHeader(status=swarm_pb2.STATE_REFUSED)
        request, nonce, refusal = self._stage_request(sealed, swarm_pb2.StateRequest, context, header)
        if refusal is not None:
            yield refusal
            return
        deadline = time.monotonic() + self._hold_s(request.wait_s)
        with self._state_wanted.get_lock():
            self._state_wanted.value += 1
        try:
            metadata, tensors, status = await self._wait_for_state(request, deadline)
            digests: list[bytes] = []
            if status == swarm_pb2.STATE_OK and request.part == swarm_pb2.STATE_PENDING:
                tensors = tensors[2 * len(self._averaged_tensors) :]
            if status == swarm_pb2.STATE_OK and request.part == swarm_pb2.STATE_PIECE:
                if injection.armed("stall_served_piece", stage=self.stage):
                    await asyncio.sleep(STALL_S)
                metadata, tensors, digests = self._piece_of(metadata, tensors, request.piece)
                if not tensors:
                    status, header.reason = swarm_pb2.STATE_REFUSED, f"no piece {request.piece} in this stage's state"
            if status == swarm_pb2.STATE_OK:
                self._owe_pending(request, metadata)
        finally:
            with self._state_wanted.get_lock():
                self._state_wanted.value -= 1
        if status != swarm_pb2.STATE_OK:
            header.status, header.boundary = status, self._boundary.value
            yield self._head(header, nonce=nonce)
            return
        chunks, digest = self._tensor_chunks(tensors)
        header = swarm_pb2.StateHeader(
            status=swarm_pb2.STATE_OK,
            boundary=metadata["boundary"],
            state_hash=metadata["state_hash"],
            n_tensors=len(tensors),
            has_pending=metadata["pending"] is not None,
            sha256=digest,
            pending_follows=metadata.get("follows", -1) >= 0,
            piece_digests=digests,
        )
        if header.pending_follows:
            header.pending.CopyFrom(swarm_pb2.AverageInfo(round=metadata["follows"]))
        if metadata["pending"] is not None:
            p = metadata["pending"]
            header.pending.CopyFrom(
                swarm_pb2.AverageInfo(
                    round=p["round"],
                    kind=p["kind"],
                    missing=[swarm_pb2.Span(start=a, end=b) for a, b in p["missing"]],
                    group=p["group"],
                )
            )
        yield self._head(header, nonce=nonce)
        for chunk in chunks:
            yield chunk

    def _piece_of(
        self, metadata: dict[str, Any], tensors: Sequence[torch.Tensor], piece: int
    ) -> tuple[dict[str, Any], list[torch.Tensor], list[bytes]]:
        """Piece `piece` of a complete state's theta_g and momentum (none where there is no such piece), the metadata
        of a state that leaves its pending average out (it follows: STATE_PENDING), and every piece's digest."""
        state = list(tensors[: 2 * len(self._averaged_tensors)])
        ranges = piece_ranges([t.numel() * t.element_size() for t in state])
        if piece >= len(ranges):
            return metadata, [], []
        key = (metadata["boundary"], metadata["state_hash"])
        if getattr(self, "_piece_digests", (None, None))[0] != key:  # a joiner asks for every piece: hashed once
            self._piece_digests = (key, piece_digests(state))
        a, b = ranges[piece]
        served = state[a:b]
        if injection.armed("corrupt_served_piece", stage=self.stage):  # a lying donor: signs what it alters
            served = [injection.flip_lowest_bit(served[0]), *served[1:]]
        pending = metadata["pending"]
        if pending is not None:
            metadata = {**metadata, "pending": None, "follows": pending["round"]}
        return metadata, served, self._piece_digests[1]

    def _owe_pending(self, request: swarm_pb2.StateRequest, metadata: dict[str, Any]) -> None:
        """A state served without its pending average (STATE_NOW) owes that average to its taker, and a piece of it
        (STATE_PIECE) owes the other pieces too (the taker asks a donor again for those another donor failed to
        serve): the worker keeps the complete state of that boundary past it until the taker asks for the average
        (averager.state_wanted), for as long as the request was willing to wait; served (STATE_PENDING), it is owed
        no more."""
        boundary = metadata["boundary"]
        piece = request.part == swarm_pb2.STATE_PIECE
        if piece or request.part == swarm_pb2.STATE_NOW and metadata.get("follows", -1) >= 0:
            with self._pending_owed.get_lock():  # one boundary is kept: a newer one, or any once the owed one expired
                if boundary >= self._pending_owed.value or time.time() > self._pending_owed_until.value:
                    self._pending_owed.value = boundary
                    self._pending_owed_until.value = time.time() + self._hold_s(request.wait_s)
        elif request.part == swarm_pb2.STATE_PENDING and self._pending_owed.value == boundary:
            self._pending_owed.value = -1

    async def _wait_for_state(self, request: swarm_pb2.StateRequest, deadline: float) -> tuple[Any, Any, int]:
        """This worker's complete state at `request.boundary`: the current one once its pending average is
        in, or, if the worker moved on before the request was served (its all-reduce is slower than
        training, or the request came late), the one it kept because a request was waiting. STATE_NOW:
        the current one at once, its pending average left out while in flight."""
        now = request.part in (swarm_pb2.STATE_NOW, swarm_pb2.STATE_PIECE)
        while True:
            boundary, ready, kept = self._boundary.value, self._state_ready.value, self._kept_boundary.value
            if boundary > request.boundary and kept != request.boundary:
                return None, None, swarm_pb2.STATE_GONE
            if (boundary == request.boundary and (ready or now)) or kept == request.boundary:
                metadata, tensors = await self._fetch_state(request.boundary, now=now)
                if metadata.get("boundary", -1) == request.boundary:
                    return metadata, tensors, swarm_pb2.STATE_OK
            if time.monotonic() >= deadline:
                return None, None, swarm_pb2.STATE_NOT_READY
            await asyncio.sleep(0.2)

    async def _fetch_state(self, boundary: int, *, now: bool = False) -> tuple[dict[str, Any], Sequence[torch.Tensor]]:
        """The host's copy of its complete state of `boundary` (metadata {"boundary": -1} if it holds none).
        Asking for the boundary, not for "the current state", matters once the worker moved on: its newer
        state may be complete too, and a copy of it would not do for a request waiting for the kept one."""
        if self._state_fetch is None:
            self._state_fetch = asyncio.Lock()
        async with self._state_fetch:
            self._state_asked.value, self._state_now.value = boundary, now
            blob, tensors, _ = await self._get_current_state_from_host_process()
        return self.serializer.loads(blob), tensors

    async def _download_round(
        self, peer_id: str, boundary: int, wait_s: float, timeout: float, part: int, future: MPFuture
    ) -> None:
        started = time.monotonic()
        try:
            header, reply = await self._ask_state(peer_id, boundary, wait_s, timeout, part, max_bytes=self._tensor_bytes(3))
            got = self._state_from(header, reply, peer_id, part)
            got.bytes_by_donor[peer_id] = reply.size
            got.seconds = time.monotonic() - started
            future.set_result(got)
        except (WireRejected, Oversized) as e:
            if not future.done():
                future.set_result(StateDownload(status=-1, boundary=-1, donor=peer_id, reason=f"refused: {e}"))
        except Exception as e:
            if not future.done():
                future.set_result(StateDownload(status=-1, boundary=-1, donor=peer_id, reason=repr(e)[:200]))

    async def _ask_state(
        self, peer_id: str, boundary: int, wait_s: float, timeout: float, part: int, *, piece: int = 0, max_bytes: int
    ) -> tuple[swarm_pb2.StateHeader, Reply]:
        """Ask `peer_id` for `part` (and `piece`) of its state at `boundary`: its signed header and the reply, read
        within the time and size limits (no more than `max_bytes`). Raises WireRejected or Oversized where the reply
        is refused, and whatever the stream raises."""
        request = swarm_pb2.StateRequest(run_id=self.run_id, config_hash=self.config_hash, stage=self.stage,
                                         boundary=boundary, wait_s=wait_s, part=part, piece=piece)  # fmt: skip
        sealed = self.signer.seal_message(request, topic=peer_id, round=boundary)
        stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
        stream = await asyncio.wait_for(stub.rpc_download_round(sealed), min(timeout, self.next_chunk_timeout))
        reply = await read_stream(stream, max_bytes=max_bytes, **self._reply_limits(wait_s, timeout + wait_s))
        return self._open_head(reply, swarm_pb2.StateHeader, peer_id, sealed), reply

    def _state_from(self, header: swarm_pb2.StateHeader, reply: Reply, donor: str, part: int) -> StateDownload:
        """The state a reply holds (STATE_PENDING: only its pending average, theta_g and momentum empty)."""
        tensors = reply.tensors
        if header.status != swarm_pb2.STATE_OK:
            return StateDownload(status=header.status, boundary=header.boundary, donor=donor, reason=header.reason)
        if header.pending_follows and (part != swarm_pb2.STATE_NOW or header.has_pending):
            return StateDownload(status=-1, boundary=header.boundary, donor=donor, reason="refused: a pending average "
                                 "left out of a reply that had to hold it")  # fmt: skip
        n = 0 if part == swarm_pb2.STATE_PENDING else len(self._averaged_tensors)
        pending_like = self._of_round(header.pending.round, self._averaged_tensors) if header.has_pending else []
        if len(tensors) != header.n_tensors or len(tensors) != 2 * n + len(pending_like):
            return StateDownload(status=-1, boundary=header.boundary, donor=donor, reason="truncated or malformed reply")
        like = [*self._averaged_tensors[:n], *self._averaged_tensors[:n], *pending_like]
        if not same_shapes(tensors, like):  # before the hash: a reply cut short is a failure, not a fault
            return StateDownload(status=-1, boundary=header.boundary, donor=donor, reason="the tensors do not fit this stage")
        if reply.sha256 != header.sha256:
            reason = "refused: the tensor bytes do not match the signed header's SHA-256 (altered on the way)"
            return StateDownload(status=-1, boundary=header.boundary, donor=donor, reason=reason)
        pending = None
        if header.has_pending:
            p = header.pending
            missing = [(s.start, s.end) for s in p.missing]
            if (why := malformed_average(p.kind, missing, sum(t.numel() for t in pending_like))) is not None:
                return StateDownload(status=-1, boundary=header.boundary, donor=donor,
                                     reason=f"refused: the pending average's {why}")  # fmt: skip
            average = Average(
                kind=AverageKind(p.kind),
                tensors=tensors[2 * n :],
                missing=tuple((s.start, s.end) for s in p.missing),
                group=tuple(p.group),
            )
            pending = PendingAverage(p.round, average)
        follows = header.pending.round if header.pending_follows else -1
        state = StageState(header.boundary, tensors[:n], tensors[n : 2 * n], pending, follows=follows)
        return StateDownload(
            status=swarm_pb2.STATE_OK, boundary=header.boundary, donor=donor, state=state, state_hash=header.state_hash
        )
