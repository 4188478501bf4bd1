"""Each round's average as a worker holds it, served to its group and collected from it.

A worker keeps its last KEEP_AVERAGES rounds' averages (`HeldAverage`: tensors, missing spans,
group) and serves them (`rpc_download_average`, signed: transfer.py), so that a member whose copy
misses spans fills them from another's (`collect` with its own copy: MENDED, or PARTIAL while spans
no member holds stay missing) and a member whose own
all-reduce failed takes the group's average (`collect` from nothing: BORROWED). Only copies of one
group's average are merged; the merged copy is what the worker then serves and applies. `adopt`
takes the copy most of the group announced (phase 5, agreement). Runs in the averager process
(DilocoxAverager, averager.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator  # typing's: hivemind reads rpc handlers' stream hints by their _name

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils import MPFuture

from .. import injection
from ..average import Average, AverageKind, Spans, all_finite, average_hash, fill_missing, malformed_average
from ..errors import WireRejected
from ..proto_gen import envelope_pb2
from ..wire import swarm_pb2
from .dial import gone, redial, unreachable
from .transfer import Oversized, Reply, limit_per_peer, read_stream, same_shapes

__all__ = ["KEEP_AVERAGES", "RESTARTED", "AverageService", "Collected", "HeldAverage"]

KEEP_AVERAGES = 3  # recent rounds' averages kept for group members that miss parts of theirs
RESTARTED = "this worker restarted"  # the reason a worker lacks a round's average: its process began after it


@dataclass
class HeldAverage:
    """A round's average as a worker holds it. Missing coordinates are zero."""

    round: int
    kind: AverageKind
    tensors: list[torch.Tensor]
    missing: Spans
    group: tuple[str, ...]
    group_id: bytes
    counted_by: tuple[tuple[str, ...] | None, ...] = ()
    """The compressed butterfly: per reducer, the members its reduced part averaged (None: not known here);
    what a member that fills its holes from this copy settles its error feedback by (Average.counted_by)."""

    def to_average(self, **extra: Any) -> Average:
        return Average(
            kind=self.kind, tensors=self.tensors, missing=self.missing, group=self.group, group_id=self.group_id,
            counted_by=self.counted_by, **extra,
        )  # fmt: skip

    def info(self) -> swarm_pb2.AverageInfo:
        return swarm_pb2.AverageInfo(
            round=self.round,
            kind=self.kind.value,
            missing=[swarm_pb2.Span(start=a, end=b) for a, b in self.missing],
            group=list(self.group),
            group_id=self.group_id,
            counted_by=[swarm_pb2.ReducerCount(known=c is not None, members=c or ()) for c in self.counted_by],
        )

    def filled_from(self, other: HeldAverage) -> tuple[tuple[str, ...] | None, ...]:
        """`counted_by` once this copy's holes are filled from `other` (a copy of the same group's average): what
        this copy does not know and `other` does, taken from `other`."""
        if len(other.counted_by) != len(self.counted_by):
            return self.counted_by
        return tuple(mine if mine is not None else theirs for mine, theirs in zip(self.counted_by, other.counted_by))


@dataclass
class Collected:
    """The result of `collect`: the merged average (or None) and who answered."""

    average: HeldAverage | None
    mended_from: list[str] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lacking: list[str] = field(default_factory=list)
    """Members that answered that they have no average of the round either."""
    elsewhere: list[str] = field(default_factory=list)
    """Members whose copy of the round's average is another group's: they averaged the round in a group of their
    own, never in this worker's (exchange._mend)."""
    replied: list[str] = field(default_factory=list)
    """Members that answered without a copy (not ready, lacking, gone past it): alive all the same."""
    gone: list[str] = field(default_factory=list)
    """Members that left the round: nothing listens at their addresses any more (dial.gone), or they restarted
    since (RESTARTED). Neither announces its copy of the round's average."""
    bytes_received: int = 0

    @property
    def alive(self) -> list[str]:
        """Members that answered, with a copy or without one: alive, whatever failed on the way to this worker."""
        return [*self.answered, *self.replied]


class AverageService:
    """The averager's (DilocoxAverager's) held averages: kept, served, collected and adopted."""

    async def _hold_buffers(
        self, round: int, kind: AverageKind, group: tuple[str, ...], group_id: bytes, missing: Spans,
        counted_by: tuple[tuple[str, ...] | None, ...], future: MPFuture,
    ) -> None:  # fmt: skip
        try:  # the host holds the buffers' lock meanwhile (exchange._hold): taken here, in the event loop, it
            # blocked the loop for good whenever an all-reduce of this process held it (a step cancelled after its
            # group formed), and with it every request this averager serves (seen: a survivor of a crash stalled)
            tensors = [t.clone() for t in self._of_round(round, self._averaged_tensors)]
            self._hold(HeldAverage(round, kind, tensors, missing, group, group_id, counted_by))
            future.set_result(None)
        except Exception as e:  # pragma: no cover - reported to the caller
            future.set_exception(e)

    def _hold(self, held: HeldAverage) -> None:
        self._held[held.round] = held
        self._held_arrived.notify()
        for old in sorted(self._held)[:-KEEP_AVERAGES]:
            del self._held[old]
            self._dropped_up_to = max(self._dropped_up_to, old)

    async def _collect(
        self,
        round: int,
        peers: list[str],
        start: HeldAverage | None,
        wait_s: float,
        deadline_s: float,
        future: MPFuture,
    ) -> None:
        try:
            future.set_result(await self._collect_from(round, peers, start, wait_s, time.monotonic() + deadline_s))
        except Exception as e:  # pragma: no cover - reported to the caller
            future.set_exception(e)

    async def _collect_from(
        self, round: int, peers: list[str], start: HeldAverage | None, wait_s: float, deadline: float
    ) -> Collected:
        out = Collected(average=start)
        if start is not None and not start.missing:
            return out
        async for peer, got in self._copies(round, peers, wait_s, deadline, out):
            out.answered.append(peer)
            mine = out.average
            if mine is None:
                out.average, out.mended_from = got, [peer]
            elif got.group_id == mine.group_id:
                tensors, missing = fill_missing(mine.tensors, mine.missing, got.tensors, got.missing)
                if missing != mine.missing:
                    out.mended_from.append(peer)
                    out.average = HeldAverage(round, mine.kind, tensors, missing, mine.group, mine.group_id,
                                              mine.filled_from(got))  # fmt: skip
            else:
                out.failures.append(f"{peer}: holds another group's average")
                out.elsewhere.append(peer)
            if not out.average.missing:
                break
        if out.average is not None:
            if start is None:
                out.average.kind = AverageKind.BORROWED
            elif out.mended_from and not out.average.missing:  # still missing spans: as partial as the others'
                out.average.kind = AverageKind.MENDED
            self._hold(out.average)  # what this worker applies is what it serves from now on
        return out

    async def _adopt(
        self, round: int, peers: list[str], want: str, wait_s: float, deadline_s: float, future: MPFuture
    ) -> None:
        try:
            out = Collected(average=None)
            async for peer, got in self._copies(round, peers, wait_s, time.monotonic() + deadline_s, out):
                if average_hash(got.tensors, got.missing) != want:
                    out.failures.append(f"{peer}: its copy is not the one its record announced")
                    continue
                out.average, out.answered, out.mended_from = got, [peer], [peer]
                self._hold(got)
                break
            future.set_result(out)
        except Exception as e:  # pragma: no cover - reported to the caller
            future.set_exception(e)

    async def _copies(
        self, round: int, peers: list[str], wait_s: float, deadline: float, out: Collected
    ) -> AsyncIterator[tuple[str, HeldAverage]]:
        """Each of `peers`' copies of round `round`'s average, asked in turn until `deadline` (what failed, who
        lacks one too and the bytes received are noted in `out`). Peers that could not be dialed are asked again
        after the others, until the deadline (dial.py)."""
        unreached = []
        for peer in peers:
            got, reason, size = await self._fetch_within(peer, round, wait_s, deadline)
            if got is None and unreachable(reason):
                unreached.append(peer)
                continue
            if got is None and ("connection refused" in reason or RESTARTED in reason):
                out.gone.append(peer)
            if self._noted(out, peer, got, reason, size):
                yield peer, got
        for peer in unreached:
            got, reason, size = await redial(lambda: self._fetch_within(peer, round, wait_s, deadline), deadline,
                                             what=f"round {round}: the average held by {peer}")  # fmt: skip
            if got is None and unreachable(reason) and await gone(reason):
                out.gone.append(peer)
            if self._noted(out, peer, got, reason, size):
                yield peer, got

    async def _fetch_within(
        self, peer: str, round: int, wait_s: float, deadline: float
    ) -> tuple[HeldAverage | None, str, int]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, "no time left", 0
        return await self._fetch_average(peer, round, min(wait_s, remaining), remaining)

    @staticmethod
    def _noted(out: Collected, peer: str, got: HeldAverage | None, reason: str, size: int) -> bool:
        """Note a fetch in `out`; whether it brought a copy."""
        out.bytes_received += size
        if got is None:
            out.failures.append(f"{peer}: {reason}")
            if reason.startswith("STATE_"):  # a signed status from the peer itself
                out.replied.append(peer)
            if reason.startswith(swarm_pb2.StateStatus.Name(swarm_pb2.STATE_LACKING)):
                out.lacking.append(peer)
        return got is not None


    async def _fetch_average(
        self, peer: str, round: int, wait_s: float, timeout: float
    ) -> tuple[HeldAverage | None, str, int]:
        request = swarm_pb2.AverageRequest(
            run_id=self.run_id, config_hash=self.config_hash, stage=self.stage, round=round, wait_s=wait_s
        )
        sealed = self.signer.seal_message(request, topic=peer, round=round)
        try:
            stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            stream = await asyncio.wait_for(stub.rpc_download_average(sealed), min(timeout, self.next_chunk_timeout))
            reply = await read_stream(stream, max_bytes=self._tensor_bytes(1), **self._reply_limits(wait_s, timeout))
        except (WireRejected, Oversized) as e:
            return None, f"refused: {e}", 0
        except Exception as e:
            return None, repr(e)[:200], 0
        return self._average_reply(reply, sealed, peer, round)

    def _average_reply(
        self, reply: Reply, sealed: envelope_pb2.SignedEnvelope, peer: str, round: int
    ) -> tuple[HeldAverage | None, str, int]:
        """A copy of round `round`'s average from `peer`'s reply to `sealed`, or why not (and the bytes received):
        its header signed by `peer` in answer, its tensors of this stage's shapes, their bytes those the header's
        SHA-256 names, finite, and the header's kind and spans well formed."""
        try:
            header = self._open_head(reply, swarm_pb2.AverageHeader, peer, sealed)
        except WireRejected as e:
            return None, f"refused: {e}", 0
        tensors, size = reply.tensors, reply.size
        if header.status != swarm_pb2.STATE_OK:
            return None, f"{swarm_pb2.StateStatus.Name(header.status)} {header.reason}".strip(), size
        # shapes first: a reply cut short (a connection reset ends the stream cleanly) is a failure, not a fault
        if len(tensors) != header.n_tensors or not same_shapes(tensors, self._of_round(round, self._averaged_tensors)):
            return None, "the tensors do not fit this stage (cut short or malformed)", size
        if reply.sha256 != header.sha256:
            return None, "refused: the tensor bytes do not match the signed header's SHA-256 (altered on the way)", size
        if not all_finite(tensors):
            return None, "refused: the average holds NaN or Inf", size
        info = header.average
        missing = tuple((s.start, s.end) for s in info.missing)
        if (why := malformed_average(info.kind, missing, sum(t.numel() for t in tensors))) is not None:
            return None, f"refused: the signed header's {why}", size
        counted_by = tuple(tuple(c.members) if c.known else None for c in info.counted_by)
        held = HeldAverage(round, AverageKind(info.kind), tensors, missing, tuple(info.group), info.group_id, counted_by)
        return held, "", size

    @limit_per_peer(swarm_pb2.AverageHeader)
    async def rpc_download_average(
        self, sealed: envelope_pb2.SignedEnvelope, context: P2PContext
    ) -> AsyncIterator[swarm_pb2.Chunk]:
        """Stream this worker's copy of round `request.round`'s average (waiting up to `wait_s` for it)."""
        header = swarm_pb2.AverageHeader(status=swarm_pb2.STATE_REFUSED)
        request, nonce, refusal = self._stage_request(sealed, swarm_pb2.AverageRequest, context, header)
        if refusal is not None:
            yield refusal
            return
        if injection.armed("hoard_average", round=request.round, stage=self.stage):
            header.status = swarm_pb2.STATE_NOT_READY
            yield self._head(header, nonce=nonce)
            return
        deadline = time.monotonic() + self._hold_s(request.wait_s)

        def restarted() -> bool:  # the member of that round's group that asks knew this worker's earlier life
            # a round before this life began, or one whose exchange the earlier life had begun and this one has not
            # (the others, mending it, waited out each request: 18 s stalls after a restart beside busy peers)
            return request.round < self._life_start.value or (
                request.round <= self._earlier_exchange.value and self._current_round < request.round
            )

        def lacking() -> bool:
            return self._current_round > request.round or self._failed_round.value == request.round or restarted()

        while request.round not in self._held and time.monotonic() < deadline and not lacking():
            # woken as the average is held; lacking() reads values other processes set: looked at again every 0.2 s
            await self._held_arrived.wait(min(0.2, deadline - time.monotonic()))
        held = self._held.get(request.round)
        if held is None and request.round <= self._dropped_up_to:
            # it had that average and moved KEEP_AVERAGES rounds past it: the asker is behind the stage group, not
            # stranded alike with it (LACKING told a joiner that fell rounds behind to keep its own state)
            header.status, header.reason = swarm_pb2.STATE_GONE, f"this worker is at round {self._current_round}"
            yield self._head(header, nonce=nonce)
            return
        if held is None:
            header.status = swarm_pb2.STATE_LACKING if lacking() else swarm_pb2.STATE_NOT_READY
            if restarted():
                header.reason = f"{RESTARTED} at round {self._life_start.value}"
            yield self._head(header, nonce=nonce)
            return
        if context.remote_id.to_base58() not in held.group and injection.armed(
                "lie_to_borrowers", round=request.round, stage=self.stage):  # fmt: skip
            held = dataclasses.replace(held, tensors=[-t for t in held.tensors], group=(self.peer_id.to_base58(),))
        chunks, digest = self._tensor_chunks(held.tensors)
        header = swarm_pb2.AverageHeader(
            status=swarm_pb2.STATE_OK, average=held.info(), n_tensors=len(held.tensors), sha256=digest
        )
        yield self._head(header, nonce=nonce)
        for chunk in chunks:
            yield chunk
