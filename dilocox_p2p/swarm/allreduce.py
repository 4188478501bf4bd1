"""hivemind's butterfly all-reduce, made exact: every member of a group gets the same bits.

hivemind's `AllReduceRunner` splits the flattened tensors into one contiguous block per
member (its reducer span); each member sums the others' parts of its block and sends the
result back. Changes here (each overridden hivemind method is listed in
hivemind_patches.py with the versions checked):

1. Members receive the reducer's averaged parts themselves, not `average - own part`
   (hivemind's differences make `a + (avg - a)` differ in the last bit from member to member).
2. A reducer averages in a fixed order (ordered_reducer.py): each part's contributions are kept per sender and
   summed in sender order in float64, then divided by their count and cast once
   (`ordered_mean`, determinism rule 2 in outer.py). Every member counts once: all peers
   train the same tokens per round, so token weights would all be equal.
3. A reducer that fails leaves the parts it had not delivered *missing*: `failed_spans()`
   names them (zeros in the output), and the outer step leaves those coordinates unchanged.
4. Bytes sent and received are counted.
5. Robust aggregation (average.screen): a reducer leaves out of each part the contributions
   that are not finite or whose norm is far above the part's median; a member refuses averaged
   parts that are not finite (that reducer counts as failed). Both name the offender in
   `offenders`, and the stage strikes it.
6. Every part a reducer receives and every averaged part a member receives is checked for its shape and
   dtype before it is used: one that does not fit is refused, its sender banned from the all-reduce (a
   reducer: failed) and named in `offenders`.
7. Every part is bound to a signed digest (issue 38, point 1), carried in hivemind's AveragingData.peer_id, which
   its runner leaves unused: a sender signs each part it sends a reducer (MessageDigest: group, SENT_PHASE, the
   reducer's index and the part's, SHA-256 of its bytes), checked before the part is reduced; a reducer signs the
   whole averaged span it sends a member (AVERAGED_PHASE, its own index, the SHA-256 of all its parts' bytes in
   order) with the span's last part, checked before the span is used (members apply the average only once the
   all-reduce ended). A part or span that does not match is refused as any malformed one. Members keep the
   reducers' digests (`reducer_digests`): phase 5 compares them, so that a reducer that sent members different
   bytes is proven by its own signatures and banned, as in the compressed butterfly (swarm/equivocation.py).
8. A member closes a reducer's stream itself once it holds the reducer's whole span, and the reducer keeps the
   stream open until then (stream_close.py): a reducer that closed first lost its last averaged parts now and
   then under load.
9. Fault injection for tests (injection.py): `withhold_average`, `hoard_average`, `read_averages_late`,
   `kill_peer_in_allreduce`, `send_nan_average`, `send_malformed_parts`, `equivocate_reduced`, `flip_served_bit`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import amap_in_executor

from .. import injection
from ..average import Spans
from ..envelope import Gate, Signer
from ..errors import WireRejected
from ..proto_gen import envelope_pb2
from .ordered_reducer import OrderedMeanReducer
from .stream_close import leave_close_to_caller

__all__ = ["AVERAGED_PHASE", "PART_BITS", "SENT_PHASE", "ExactAllReduceRunner", "digest_refusal", "read_part"]

logger = logging.getLogger(__name__)

SENT_PHASE = 101  # MessageDigest.phase of a sender's part of the fp32 butterfly (the compressed ones use 1-4)
AVERAGED_PHASE = 102  # ... of a reducer's averaged span
PART_BITS = 20  # a sent part's MessageDigest.part: the reducer's index << PART_BITS | the part's index
READ_LATE_S = 2.0  # fault injection `read_averages_late`: how long a member leaves its averaged parts unread


def _sha256(tensor_part: Any) -> bytes:
    return hashlib.sha256(tensor_part.buffer).digest()


def read_part(message: averaging_pb2.AveragingData) -> tuple[torch.Tensor | None, str]:
    """The tensor a part or averaged part carries, or why it carries none: bytes that make no tensor, or a compressed
    tensor (the fp32 butterfly sends raw float32, and a digest binds the raw bytes: another compression field would
    read them as other values)."""
    if message.tensor_part.compression != runtime_pb2.CompressionType.NONE:
        return None, f"is compressed (compression type {int(message.tensor_part.compression)})"
    try:
        return deserialize_torch_tensor(message.tensor_part), ""
    except Exception as e:  # noqa: BLE001 - any malformed bytes: a refusal, never a crash of the stream's reader
        return None, f"makes no tensor ({type(e).__name__})"


def digest_refusal(gate: Gate, sealed: bytes, *, author: str, key: tuple[bytes, int, int], size: int, sha256: bytes) -> str:
    """Why `sealed` is not `author`'s signed MessageDigest of (group, phase, part) = `key` for bytes of `size` and
    `sha256` ("" if it is)."""
    try:
        digest = gate.open(sealed, envelope_pb2.MessageDigest, sender=author, even_banned=True).message
    except WireRejected as e:
        return f"came without its author's signed digest ({e})"
    if (digest.group_id, digest.phase, digest.part) != key:
        return "came behind a digest of another group, span or part (replayed)"
    if (digest.size, digest.sha256) != (size, sha256):
        return "does not match its author's signed SHA-256 (altered)"
    return ""


class _CountingStub:
    """Wraps a peer stub so that averaged parts received from that reducer are counted."""

    def __init__(self, stub: Any, runner: ExactAllReduceRunner, peer: PeerID):
        self._stub, self._runner, self._peer = stub, runner, peer

    async def rpc_aggregate_part(self, inputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        stream = await self._stub.rpc_aggregate_part(inputs)
        return self._runner._count_received(stream, check_from=self._peer)


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce that hands members the averaged parts, in a fixed summation order."""

    def __init__(
        self,
        *,
        kill_on_first_part: bool = False,
        withhold: bool = False,
        hoard: bool = False,
        read_late: bool = False,
        nan_average: bool = False,
        malformed_parts: str = "",
        max_norm_ratio: float = 10.0,
        clip_ratio: float = 0.0,
        direction_screen: bool = False,
        signer: Signer,
        gate: Gate,
        equivocate: bool = False,
        flip: bool = False,
        **kwargs: Any,
    ):
        kwargs["weight"] = 1.0  # every member counts once (module docstring, point 2)
        super().__init__(**kwargs)
        self.tensor_part_reducer.finished.set()  # hivemind's reducer is replaced unused: no "received 0.0%" warning
        self.tensor_part_reducer = OrderedMeanReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            max_norm_ratio=max_norm_ratio,
            clip_ratio=clip_ratio,
            direction_screen=direction_screen,
        )
        self.nan_average = nan_average
        self.malformed_parts = malformed_parts  # fault injection: "scalar" or "wide" parts sent to every reducer
        self.reducer_offenses: dict[PeerID, str] = {}  # reducers whose averaged parts this member refused
        container = self.tensor_part_container
        # reducer i owns a contiguous block of the flattened tensors: remember its part sizes
        self.part_sizes_by_peer = [[part.numel() for part, _ in parts] for parts in container._input_parts_by_peer]
        self.failed_from: dict[int, int] = {}  # reducer index -> first part it did not deliver
        self.outsiders: set[PeerID] = set()  # members that answered that they are in no such group
        self.bytes_sent = self.bytes_received = 0
        self.kill_on_first_part = kill_on_first_part
        me = self.ordered_peer_ids.index(self.peer_id)
        after_me = self.ordered_peer_ids[(me + 1) % len(self.ordered_peer_ids)]
        self.withhold_from = self.sender_peer_ids.index(after_me) if withhold and after_me != self.peer_id else None
        self.hoard, self.read_late = hoard, read_late
        self.signer, self.gate, self.equivocate, self.flip = signer, gate, equivocate, flip
        self.reducer_digests: dict[int, bytes] = {}  # reducer index -> its signed digest of the span it sent here
        register_failed = container.register_failed_reducer

        def on_failed_reducer(peer_index: int) -> None:
            self.failed_from.setdefault(peer_index, container._outputs_registered_by_peer[peer_index])
            register_failed(peer_index)  # registers zeros for the parts not delivered

        container.register_failed_reducer = on_failed_reducer

    async def _ban_sender(self, peer_id: PeerID) -> None:
        """As hivemind's, and once every sender has started or is banned, the wait for missing senders ends:
        hivemind's waits for every sender to *start* (`all_senders_started`) up to sender_timeout, and the
        all-reduce ends only after that wait. A member banned before it sent anything (an outsider, a member
        killed before its first part) made every other member's all-reduce last sender_timeout more: 5 s of
        a leader's all-reduce with an outsider, past which its stage no longer looked for a group again."""
        await super()._ban_sender(peer_id)
        self._check_senders_started()

    async def _handle_missing_senders(self) -> None:
        """hivemind's (senders that never started within sender_timeout are banned), saying whom it banned: a sender
        banned but never started is one of those, or an outsider (said where it is found: _communicate_with_peer)."""
        await super()._handle_missing_senders()
        for peer_id in self.sender_peer_ids:
            if peer_id in self.banned_senders and peer_id not in self.active_senders and peer_id not in self.outsiders:
                logger.info("sender %s never started within %.1f s: banned from this all-reduce", peer_id,
                            self.sender_timeout)  # fmt: skip

    def _check_senders_started(self) -> None:
        """End the wait for senders once each has started or is banned (hivemind's counts started ones only)."""
        if set(self.sender_peer_ids) <= self.active_senders | self.banned_senders:
            self.all_senders_started.set()

    def failed_spans(self) -> Spans:
        """Coordinates whose reducer failed before delivering them to this member."""
        spans, start = [], 0
        for index, sizes in enumerate(self.part_sizes_by_peer):
            if index in self.failed_from:
                lo = start + sum(sizes[: self.failed_from[index]])
                if lo < start + sum(sizes):
                    spans.append((lo, start + sum(sizes)))
            start += sum(sizes)
        return tuple(spans)

    def offenders(self) -> dict[str, str]:
        """Members whose contributions (as senders) or averages (as reducers) were refused here, and why."""
        out = {self.sender_peer_ids[i].to_base58(): r for i, r in self.tensor_part_reducer.offenses.items()}
        out.update({p.to_base58(): r for p, r in self.reducer_offenses.items()})
        return out

    async def _count_received(self, stream: AsyncIterator[Any], check_from: PeerID | None = None) -> AsyncIterator[Any]:
        """Count the bytes of `stream`; with `check_from`, refuse (as that reducer's failure) an averaged
        part that is not of the shape and dtype of that reducer's part or not finite."""
        shapes = []
        if check_from is not None:
            shapes = [part.shape for part, _ in self.tensor_part_container._input_parts_by_peer[
                self.ordered_peer_ids.index(check_from)]]  # fmt: skip
        index, span, size = 0, hashlib.sha256(), 0
        if check_from is not None and self.read_late:  # fault injection: a member on a loaded machine
            await asyncio.sleep(READ_LATE_S)
        async for message in stream:
            self.bytes_received += message.ByteSize()
            if check_from is not None and message.code == averaging_pb2.AVERAGED_PART:
                part, why = read_part(message)
                span.update(message.tensor_part.buffer)
                size += len(message.tensor_part.buffer)
                why = why or self._misfit(part, shapes, index) or (
                    None if bool(torch.isfinite(part).all()) else "holds NaN or Inf")  # fmt: skip
                if why is None and index == len(shapes) - 1:
                    why = self._span_digest_refusal(check_from, message.peer_id, size, span.digest())
                if why is not None:
                    self.reducer_offenses[check_from] = f"sent an averaged part that {why}"
                    logger.warning("refused an averaged part from %s: it %s", check_from, why)
                    self.failed_from[self.ordered_peer_ids.index(check_from)] = 0  # none of its span is used
                    raise AllreduceException(f"{check_from} sent an averaged part that {why}")
                index += 1
            yield message
            if shapes and index == len(shapes):
                # the whole span is here: close the stream now, before the reducer does (stream_close.py)
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
                return

    def _span_digest_refusal(self, reducer: PeerID, sealed: bytes, size: int, sha256: bytes) -> str | None:
        """Why `sealed` is not `reducer`'s signed digest of the span whose parts' bytes are `size` long and hash to
        `sha256` (None: it is; kept for phase 5)."""
        index = self.ordered_peer_ids.index(reducer)
        why = digest_refusal(self.gate, sealed, author=reducer.to_base58(), key=(self.group_id, AVERAGED_PHASE, index),
                             size=size, sha256=sha256)  # fmt: skip
        if why:
            return why
        self.reducer_digests[index] = sealed
        return None

    def _part_digest_refusal(self, sender_index: int, part_index: int, sealed: bytes, size: int, sha256: bytes) -> str | None:
        """Why `sealed` is not the sender's signed digest of its `part_index`-th part to this reducer (None: it is)."""
        me = self.ordered_peer_ids.index(self.peer_id)
        return digest_refusal(self.gate, sealed, author=self.sender_peer_ids[sender_index].to_base58(),
                              key=(self.group_id, SENT_PHASE, me << PART_BITS | part_index), size=size,
                              sha256=sha256) or None  # fmt: skip

    def _seal(self, phase: int, part: int, size: int, sha256: bytes) -> bytes:
        return self.signer.seal(envelope_pb2.MessageDigest(group_id=self.group_id, phase=phase, part=part, size=size,
                                                           sha256=sha256))  # fmt: skip

    @staticmethod
    def _misfit(part: torch.Tensor, shapes: Any, index: int) -> str | None:
        """Why `part` cannot be the `index`-th of parts of `shapes` (None: it can): more parts than there are, another
        shape, or not float32. Checked before any use: a scalar was broadcast to every coordinate, and a part of
        shape (2, n) raised in the reducer and stalled the other senders."""
        if index >= len(shapes):
            return f"is one more than the {len(shapes)} expected"
        if part.shape != shapes[index] or part.dtype != torch.float32:
            return f"has shape {tuple(part.shape)} and dtype {part.dtype} where {tuple(shapes[index])} float32 was expected"
        return None

    def _get_peer_stub(self, peer: PeerID) -> Any:
        return _CountingStub(super()._get_peer_stub(peer), self, peer)

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        if peer_id != self.peer_id:
            try:
                return await super()._communicate_with_peer(peer_id)
            except Exception as e:
                # a member that does not know the group never joined it (the leader counted a follower that
                # had given up on it: matchmaking.py): it sends nothing either, so stop waiting for its parts
                if isinstance(e, AllreduceException) and "BAD_GROUP_ID" in str(e) and peer_id in self.sender_peer_ids:
                    logger.info("%s is not in this group (it never took the leader's answer): left out", peer_id)
                    self.outsiders.add(peer_id)
                    await self._ban_sender(peer_id)
                else:
                    self._log_failed_reducer(peer_id, e)
                raise
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        try:
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged_part = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part)
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged_part)
        except BaseException as e:
            # hivemind lets this task die silently, and the outputs then wait forever for our own parts; a step cut
            # by its deadline (cancelled) is no failure worth a warning
            logger.log(logging.DEBUG if isinstance(e, asyncio.CancelledError) else logging.WARNING,
                       "local reduction failed: %r", e)  # fmt: skip
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    def finalize(self, *, cancel: bool = False, exception: BaseException | None = None) -> Any:
        """As hivemind's, but an all-reduce ended by a CancelledError (its step cut by the deadline) is cancelled, not
        failed: hivemind set the CancelledError as the runner's exception, which nobody retrieves, and asyncio then
        logged "Future exception was never retrieved" at ERROR, with a traceback, for every all-reduce a deadline
        ended (3 of them in a normal run of tests/netns/test_learned_deadlines.py)."""
        if isinstance(exception, asyncio.CancelledError):
            cancel, exception = True, None
        return super().finalize(cancel=cancel, exception=exception)

    def _log_failed_reducer(self, peer_id: PeerID, error: BaseException) -> None:
        """Say why a reducer's averaged parts stopped coming (hivemind says so at debug level only): its span is
        then missing here and mended after the round, and a test that expected `averaged` needs the reason. Once
        this all-reduce itself has ended (its step cut by the deadline), the reducer did not fail: hivemind's
        finalize() emptied the parts still to send, and the send then raised IndexError('deque index out of range')."""
        index = self.ordered_peer_ids.index(peer_id)
        received = self.failed_from.get(index, self.tensor_part_container._outputs_registered_by_peer[index])
        total = self.tensor_part_container.num_parts_by_peer[index]
        if self._future.done():
            logger.debug("this all-reduce ended after %d of reducer %s's %d averaged parts (%r)", received, peer_id,
                         total, error)  # fmt: skip
            return
        logger.info("reducer %s failed: %d of its %d averaged parts came before %r", peer_id, received, total, error)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        part_index = 0
        async for message in super()._generate_input_for_peer(peer_index):
            if self.malformed_parts:  # fault injection: a hostile sender's parts of another shape
                part = deserialize_torch_tensor(message.tensor_part)
                bad = part.norm() if self.malformed_parts == "scalar" else torch.stack([part, part])  # norms pass the screen
                message.tensor_part.CopyFrom(serialize_torch_tensor(bad))
            buffer = message.tensor_part.buffer
            message.peer_id = self._seal(SENT_PHASE, peer_index << PART_BITS | part_index, len(buffer), _sha256(message.tensor_part))
            if self.flip:  # fault injection: a bit flipped on the way, after signing
                message.tensor_part.buffer = injection.flip_last_bit(buffer)
            part_index += 1
            self.bytes_sent += message.ByteSize()
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # a sender that starts after another was banned (an outsider) is the last one awaited: hivemind's own check
        # here counts started senders only, and every member then waited sender_timeout (5 s) more for the outsider
        # (test_a_member_whose_matchmaking_fails_after_its_leader_counted_it_in...: a 3-member group)
        if context.remote_id in self.sender_peer_ids:
            self.active_senders.add(context.remote_id)
            self._check_senders_started()
        answered, ended = 0, "closed"
        try:
            async for message in super().rpc_aggregate_part(self._count_received(stream), context):
                answered += message.code == averaging_pb2.AVERAGED_PART
                yield message
            ended = "ended"
            if answered == self.tensor_part_reducer.num_parts:
                # the member closes the stream once it holds the span: closed here first, the span's last parts
                # could be lost on the way (stream_close.py)
                ended = "left to the member"
                await leave_close_to_caller(logger, context.remote_id, "part stream", f"the span's {answered} parts")
        except asyncio.CancelledError:
            if ended != "left to the member":
                ended = "cancelled"
            raise
        finally:
            # a member whose stream ends short sees only "sent 27 parts, but we expected 28": say here how far this
            # side got and how it ended: the parts ran out ("ended"), hivemind's stream handler cancelled it once its
            # connection closed ("cancelled"), or it was dropped at a reply ("closed"). (The short streams of CI run
            # 201 were none of these: every part was sent, and the daemon dropped the tail: stream_close.py.)
            if context.remote_id in self.sender_peer_ids and 0 < answered < self.tensor_part_reducer.num_parts:
                logger.info("the part stream of %s %s after %d of its %d averaged parts", context.remote_id, ended,
                            answered, self.tensor_part_reducer.num_parts)  # fmt: skip

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """As hivemind's, but replies with the averaged part itself."""
        part_index, span, size = 0, hashlib.sha256(), 0
        me = self.ordered_peer_ids.index(self.peer_id)
        try:
            loop = asyncio.get_event_loop()
            async for (tensor_part, unread), part_compression, sealed, part_size, sha256 in amap_in_executor(
                lambda msg: (read_part(msg), msg.tensor_part.compression, msg.peer_id, len(msg.tensor_part.buffer),
                             _sha256(msg.tensor_part)),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):  # fmt: skip
                if self.kill_on_first_part:
                    injection.kill_peer("kill_peer_in_allreduce")
                why = unread or self._misfit(tensor_part, self.tensor_part_reducer.part_shapes, part_index) or \
                    self._part_digest_refusal(sender_index, part_index, sealed, part_size, sha256)  # fmt: skip
                if why is not None:
                    self.tensor_part_reducer.offenses.setdefault(sender_index, f"its part {part_index} {why}")
                    logger.warning("refused the parts of sender %s: its part %d %s", self.sender_peer_ids[sender_index],
                                   part_index, why)  # fmt: skip
                    break  # banned below: the others' parts are averaged without it, nobody waits for it
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part)
                    part_index += 1
                except BannedException:  # its stream ends here, short: say so (hivemind bans some senders silently)
                    logger.info("sender %s was banned from this all-reduce: its stream ends after %d of %d parts",
                                self.sender_peer_ids[sender_index], part_index, self.tensor_part_reducer.num_parts)  # fmt: skip
                    break
                if sender_index == self.withhold_from or self.hoard:
                    continue  # fault injection: this sender's data counts, but it never gets the average
                if self.nan_average:  # fault injection: a byzantine reducer
                    averaged_part = torch.full_like(averaged_part, float("nan"))
                serialized = await loop.run_in_executor(
                    None, lambda: serialize_torch_tensor(averaged_part, part_compression)
                )
                if self.equivocate:  # fault injection: other bytes for each member, behind digests signed for them
                    serialized.buffer = injection.flip_middle_bit(serialized.buffer, sender_index)
                span.update(serialized.buffer)
                size += len(serialized.buffer)
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                if part_index == self.tensor_part_reducer.num_parts:  # the span's last part: its signed digest
                    message.peer_id = self._seal(AVERAGED_PHASE, me, size, span.digest())
                if self.flip:  # fault injection: a bit flipped on the way, after signing
                    message.tensor_part.buffer = injection.flip_last_bit(serialized.buffer)
                self.bytes_sent += message.ByteSize()
                yield message
        except Exception as e:
            logger.info("the parts of sender %s failed after %d: %r", self.sender_peer_ids[sender_index], part_index, e)
            raise
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                sender = self.sender_peer_ids[sender_index]
                if sender not in self.banned_senders and not self.tensor_part_reducer.finished.is_set():
                    logger.info(
                        "sender %s sent %d of its %d parts: banned from this all-reduce",
                        sender, part_index, self.tensor_part_reducer.num_parts,
                    )  # fmt: skip
                await self._ban_sender(sender)
