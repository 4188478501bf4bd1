"""All-gather of compressed messages within a stage group (the averager process's side).

Compressed pseudo-gradients (compression/) are not summed part by part in the butterfly:
a sparse top-k message has no dense parts, and a quantized sum would have to be quantized
again. Instead every member of the round's group (formed by hivemind's matchmaking) takes
every other member's whole message, and each decodes the same set in the same order
(codec.py). Bytes per member and phase: (N - 1) messages out, (N - 1) in.

    member A                                member B
      box[(group, phase)][A] = payload        box[(group, phase)][B] = payload
      pull B's message from B   <---------->  pull A's message from A     (rpc_download_message)
      a message still missing: pull it from a member that has it (relaying), so that every
      member that stays reachable ends with the same set

The compressed butterfly (compression/butterfly.py) uses the same pulls twice: `_scatter` holds
a member's message in parts, part i + 1 for the group's reducer i, and pulls the parts of its
own span from every member (nobody else holds them: no relays); then the reducers' reduced
parts are all-gathered like messages. Each part travels behind its author's digest, which
names the part.

Messages are pulled, never pushed: a worker holds only what it asked for. What a member could
not get by the deadline is None in the result; the worker decodes what it has and says so.
Each message travels behind its author's signed MessageDigest (group, phase, size and
SHA-256) as the reply's header, which relays pass on unchanged: a message altered anywhere on
the way is refused, and the member that served it is named in `offenders` (the stage strikes
it). A reply without the message is a GatherHeader signed by the member asked, answering the
request's nonce.
A member returns once the others have pulled its message too (or a few seconds passed), so
the bytes it served are counted with the round they belong to. Nothing here polls: a request for a
message not yet held, and a member waiting for its message to be pulled, wake when it is (`Arrivals`);
each poll of 50 ms cost a step of the butterfly 25 ms on average, four steps for low-rank.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, AsyncIterator  # typing's: hivemind reads rpc handlers' stream hints by their _name

from hivemind.p2p import P2PContext, PeerID

from .. import injection
from ..compression.butterfly import REDUCED
from ..envelope import Gate, Signer
from ..errors import WireRejected
from ..proto_gen import envelope_pb2
from ..wire import swarm_pb2
from .dial import redial
from .transfer import limit_per_peer

__all__ = ["Arrivals", "GatherResult", "MessageGather", "MessageReply"]

logger = logging.getLogger(__name__)

PAYLOAD_PART = 1 << 19  # bytes per streamed part
KEYS_KEPT = 2  # (group, phase) inboxes kept: this phase and the one before, for members a step behind
DELIVERY_WAIT_S = 3.0  # how long a member waits for the others to pull its message
RELAY_WAIT_S = 2.0  # how long a holder is asked to wait for a message it may still be pulling itself
CUT_SHORT = "cut short"  # a pull whose stream ended before the whole message came: asked again, never a strike
OUTSIDE = "in no such group"  # the answer of a member a leader counted in after it had given up on the leader
OUTSIDE_RECHECK_S = 0.25  # how often a request waiting for a message asks again whether this worker is in its group


class Arrivals:
    """Wakes the coroutines of one event loop that wait for something to arrive (a message into the inbox, a pull of
    this worker's message): each checks its own condition again when woken."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout: float) -> None:
        """Until the next `notify`, or `timeout` seconds."""
        if timeout <= 0:
            return
        if self._event is None:
            self._event = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


@dataclass
class GatherResult:
    """The messages of one phase, in group order (None: never received), and the bytes it took."""

    messages: list[bytes | None]
    bytes_sent: int = 0
    bytes_received: int = 0
    failures: list[str] = field(default_factory=list)
    offenders: dict[str, str] = field(default_factory=dict)
    """Members that served a message that failed its author's digest, and why."""
    outsiders: list[str] = field(default_factory=list)
    """Members that answered they are in no such group (OUTSIDE): alive, their message never existed."""
    digests: list[bytes | None] = field(default_factory=list)
    """All-gathers: each message's author's signed digest, in group order (None: never received)."""


@dataclass
class MessageReply:
    """A holder's answer to a GatherRequest as read so far: its header (a signed digest or a GatherHeader) and the
    message's payload parts."""

    head: Any = None
    parts: list[bytes] = field(default_factory=list)
    size: int = 0

    async def read(self, stream: AsyncIterator[swarm_pb2.Chunk], max_bytes: int) -> None:
        """Read `stream` to its end (no more than `max_bytes`: raises WireRejected)."""
        async for chunk in stream:
            self.size += chunk.ByteSize()
            if self.head is None:
                self.head = chunk.head
            else:
                self.parts.append(chunk.payload)
            if self.size > max_bytes:
                raise WireRejected("message larger than this stage's messages can be")


class MessageGather:
    """Mixin for DilocoxAverager: hold this worker's messages, serve them, pull the group's."""

    run_id: str
    config_hash: str
    stage: int
    prefix: str
    signer: Signer
    gate: Gate
    _p2p: Any
    _current_round: int = -1  # the round the averager's step is in (averager.py sets it); fault injection reads it

    def _init_gather(self, max_message_bytes: int) -> None:
        self._my_id = ""  # this worker's peer id, known once the averager process runs
        self._equivocated: dict[tuple[bytes, int], int] = {}  # fault injection (equivocate_reduced): parts served
        # (group, phase) -> (sender, part) -> (message, the author's signed MessageDigest); part 0 is a whole
        # message, part i + 1 the part of it for the group's reducer i (the compressed butterfly)
        self._inbox: collections.OrderedDict[tuple[bytes, int], dict[tuple[str, int], tuple[bytes, bytes]]] = (
            collections.OrderedDict()
        )
        self._max_message_bytes = max_message_bytes
        self._served: dict[bytes, int] = collections.defaultdict(int)  # bytes served per group, not yet reported
        self._delivered: dict[tuple[bytes, int], set[str]] = collections.defaultdict(set)  # who pulled my message
        self._messages_served = 0  # replies that carried a message, counted for fault injection
        self._arrived = Arrivals()  # a message entered the inbox
        self._pulled_here = Arrivals()  # a member pulled this worker's message

    def _put(self, box: dict[tuple[str, int], tuple[bytes, bytes]], which: tuple[str, int], held: tuple[bytes, bytes]) -> None:
        """Hold `held` (a message or part and its author's signed digest) as (sender, part) = `which` in `box`; wake
        the requests waiting for it."""
        box[which] = held
        self._arrived.notify()

    async def _outside_group(self, group_id: bytes, sender: PeerID | None = None) -> bool:
        """Whether this worker is in no group `group_id` and about to join none (the averager knows; `sender`, a
        member of that group, may name it)."""
        return False

    async def _outside_group_now(self, group_id: bytes, sender: PeerID | None = None) -> bool:
        """`_outside_group` asked again while a request waits, without waiting itself."""
        return False

    def _box(self, group_id: bytes, phase: int) -> dict[tuple[str, int], tuple[bytes, bytes]]:
        key = (group_id, phase)
        if key not in self._inbox:
            self._inbox[key] = {}
            while len(self._inbox) > KEYS_KEPT:
                old, _ = self._inbox.popitem(last=False)
                self._delivered.pop(old, None)
                if all(group != old[0] for group, _ in self._inbox):
                    self._served.pop(old[0], None)
        return self._inbox[key]

    async def _all_gather(
        self, group_id: bytes, phase: int, peers: Sequence[str], me: str, payload: bytes, deadline: float,
        *, clients: Sequence[str] = (), takers: Sequence[str] = (),
    ) -> GatherResult:  # fmt: skip
        """Every message of (group_id, phase) by the members `peers`, in that order; this worker's own is `payload`
        where it is one of them (a client member takes the reducers' reduced parts and serves none). A client
        member pulls another client's message from members that hold it: neither can dial the other. `takers`:
        members besides those of `peers` that answered that will pull this worker's message (client members that
        take a reducer's reduced part), waited for as they are."""
        self._my_id = me
        box = self._box(group_id, phase)
        if me in peers:
            self._put(box, (me, 0), (payload, self._sealed_digest(group_id, phase, 0, payload)))
        result = GatherResult(messages=[])
        others = [p for p in peers if p != me]
        direct = [p for p in others if me not in clients or p not in clients]
        answered, outsiders = await self._pull_from_each(direct, group_id, phase, 0, deadline, result)
        for sender in [p for p in others if (p, 0) not in box and p not in outsiders]:  # relay what missed this worker
            for holder in answered:
                until = min(deadline, time.monotonic() + RELAY_WAIT_S)
                got, reason, size = await self._pull_whole(holder, group_id, phase, sender, until)
                result.bytes_received += size
                if got is not None:
                    self._put(box, (sender, 0), got)
                    logger.info("phase %d: %s's message relayed by %s", phase, sender, holder)
                    break
                if reason.startswith("refused"):
                    result.offenders[holder] = reason
        result.messages = [box[(p, 0)][0] if (p, 0) in box else None for p in peers]
        result.digests = [box[(p, 0)][1] if (p, 0) in box else None for p in peers]
        result.outsiders = sorted(outsiders)
        takers = [*answered, *takers] if me in peers else []
        result.bytes_sent = await self._delivered_to(takers, group_id, phase, deadline)
        return result

    async def _scatter(
        self, group_id: bytes, phase: int, peers: Sequence[str], me: str, parts: Sequence[bytes], deadline: float,
        *, reducers: Sequence[str] | None = None,
    ) -> GatherResult:  # fmt: skip
        """The compressed butterfly's first step: this worker's message in parts, one per reducer (`reducers`, in
        group order: `peers` but the client members), each served to that reducer only; returns the parts of this
        worker's own span from every member of `peers`, in group order (None: never came; nobody else holds them,
        so nothing is relayed). A client member reduces no span: it returns at once (the reducers take its parts before
        they serve the reduced parts it pulls next)."""
        self._my_id = me
        reducers = list(peers) if reducers is None else list(reducers)
        assert len(parts) == len(reducers), f"{len(parts)} parts for {len(reducers)} reducers"
        box = self._box(group_id, phase)
        for part, payload in enumerate(parts, start=1):
            self._put(box, (me, part), (payload, self._sealed_digest(group_id, phase, part, payload)))
        result = GatherResult(messages=[])
        if me not in reducers:  # a client member (client_member.py): the reducers pull over the links it opened
            result.bytes_sent = self._sent_since(group_id)  # counted with its next step (below)
            return result
        mine = reducers.index(me) + 1
        others = [p for p in peers if p != me]
        _, outsiders = await self._pull_from_each(others, group_id, phase, mine, deadline, result)
        result.messages = [box[(p, mine)][0] if (p, mine) in box else None for p in peers]
        result.outsiders = sorted(outsiders)
        # no wait for the reducers to take this worker's parts: its reduce goes on at once, and a reducer serves its
        # reduced part only once it took them. What is served of them from now on is counted with the next step
        result.bytes_sent = self._sent_since(group_id)
        return result

    async def _pull_from_each(
        self, authors: Sequence[str], group_id: bytes, phase: int, part: int, deadline: float, result: GatherResult
    ) -> tuple[list[str], set[str]]:
        """Pull each author's `part` of (group, phase) from the author itself, at once, into this worker's box;
        count bytes, failures and offenders into `result`. Returns (the authors that answered, those in no such
        group: they never learnt of it, so nobody holds their message)."""
        box = self._box(group_id, phase)
        pulls = [self._pull_whole(p, group_id, phase, p, deadline, part=part) for p in authors]
        answered, outsiders = [], set()
        for peer, (got, reason, size) in zip(authors, await asyncio.gather(*pulls)):
            result.bytes_received += size
            if got is None:
                result.failures.append(f"{peer}: {reason}")
                if reason.startswith("refused"):
                    result.offenders[peer] = reason
                elif reason.endswith(OUTSIDE):
                    outsiders.add(peer)
            else:
                self._put(box, (peer, part), got)
                answered.append(peer)
        return answered, outsiders

    def _sealed_digest(self, group_id: bytes, phase: int, part: int, payload: bytes) -> bytes:
        digest = envelope_pb2.MessageDigest(
            group_id=group_id, phase=phase, part=part, size=len(payload), sha256=hashlib.sha256(payload).digest()
        )
        return self.signer.seal(digest)

    async def _delivered_to(self, members: Sequence[str], group_id: bytes, phase: int, deadline: float) -> int:
        """Wait (a few seconds at most) until `members` pulled what this worker holds for them of (group, phase),
        so that the bytes served are counted with the round they belong to; returns the bytes served to the group
        since the last step's count (`_sent_since`)."""
        key, until = (group_id, phase), min(deadline, time.monotonic() + DELIVERY_WAIT_S)
        while not set(members) <= self._delivered[key] and time.monotonic() < until:
            await self._pulled_here.wait(until - time.monotonic())
        return self._sent_since(group_id)

    def _sent_since(self, group_id: bytes) -> int:
        """The bytes this worker served to the group `group_id` since the last count: each byte counted once, by the
        step that returns after it was served (a scatter does not wait for its parts to be taken)."""
        return self._served.pop(group_id, 0)

    async def _pull_whole(
        self, holder: str, group_id: bytes, phase: int, sender: str, deadline: float, *, part: int = 0
    ) -> tuple[tuple[bytes, bytes] | None, str, int]:
        """`_pull`, asked again while the holder cannot be dialed (dial.py), and once more when the stream ended
        before the whole message came (a connection reset mid-reply ends hivemind's stream without an error): a
        short message is a failure, not a fault."""
        got, reason, size = await redial(lambda: self._pull(holder, group_id, phase, sender, deadline, part), deadline,
                                         what=f"phase {phase}: {sender}'s message from {holder}")  # fmt: skip
        if got is None and reason.startswith(CUT_SHORT):
            logger.info("phase %d: %s's message from %s %s: asking again", phase, sender, holder, reason)
            got, reason, more = await self._pull(holder, group_id, phase, sender, deadline, part)
            size += more
        return got, reason, size

    async def _pull(
        self, holder: str, group_id: bytes, phase: int, sender: str, deadline: float, part: int = 0
    ) -> tuple[tuple[bytes, bytes] | None, str, int]:
        """`sender`'s message and its author's signed digest, pulled from `holder`; or why not (a reason
        starting with "refused" blames the holder)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None, "no time left", 0
        request = swarm_pb2.GatherRequest(
            run_id=self.run_id, config_hash=self.config_hash, stage=self.stage,
            group_id=group_id, phase=phase, sender=sender, wait_s=remaining, part=part,
        )  # fmt: skip
        sealed = self.signer.seal_message(request, topic=holder)
        nonce = envelope_pb2.Envelope.FromString(sealed.body).nonce
        reply = MessageReply()
        try:
            stub = type(self).get_stub(self._p2p, PeerID.from_base58(holder), namespace=self.prefix)  # type: ignore[attr-defined]
            stream = await asyncio.wait_for(stub.rpc_download_message(sealed), remaining)
            await asyncio.wait_for(reply.read(stream, self._max_message_bytes + 65536),
                                   max(deadline - time.monotonic(), 0.1) + 5.0)  # fmt: skip
        except WireRejected as e:
            return None, f"refused: {e}", reply.size
        except Exception as e:
            return None, repr(e)[:200], reply.size
        got, reason = self._pulled(reply, holder=holder, sender=sender, key=(group_id, phase, part), nonce=nonce)
        return got, reason, reply.size

    def _pulled(
        self, reply: MessageReply, *, holder: str, sender: str, key: tuple[bytes, int, int], nonce: bytes
    ) -> tuple[tuple[bytes, bytes] | None, str]:
        """`sender`'s message of (group_id, phase, part) = `key` from `holder`'s `reply` to the request of `nonce`,
        with its author's signed digest; or why not (a reason starting with "refused" blames the holder)."""
        head = reply.head
        if head is None:  # every answer starts with a header: the connection was reset before it came
            return None, f"{CUT_SHORT}: the stream ended before any reply"
        try:
            opened = self.gate.open(head, (envelope_pb2.MessageDigest, swarm_pb2.GatherHeader))
        except WireRejected as e:
            return None, f"refused: {e}"
        if isinstance(opened.message, swarm_pb2.GatherHeader):
            header = opened.message
            if opened.sender != holder or opened.envelope.in_reply_to != nonce:
                return None, "refused: a status reply not signed by the member asked, for this request"
            return None, f"{swarm_pb2.StateStatus.Name(header.status)} {header.reason}".strip()
        blob, digest = b"".join(reply.parts), opened.message
        if opened.sender != sender:
            return None, f"refused: {sender}'s message came behind a digest signed by {opened.sender}"
        if (digest.group_id, digest.phase, digest.part) != key:
            return None, f"refused: {sender}'s digest is of another group, phase or part (replayed)"
        if len(blob) < digest.size:  # the stream ended early: a reset connection reads as a clean end in hivemind
            return None, f"{CUT_SHORT}: {len(blob)} of {digest.size} bytes before the stream ended"
        if len(blob) != digest.size or hashlib.sha256(blob).digest() != digest.sha256:
            return None, f"refused: {sender}'s message does not match its author's signed SHA-256 (altered)"
        return (blob, head), ""

    async def _found_outside_waiting(self, request: swarm_pb2.GatherRequest, remote: PeerID) -> bool:
        """Wait (`request.wait_s`, 120 s at most) until this worker holds the message `request` asks for; True as
        soon as it finds itself outside the request's group meanwhile (`_outside_group_now`), False otherwise."""
        deadline = time.monotonic() + min(max(request.wait_s, 0.0), 120.0)
        key, which = (request.group_id, request.phase), (request.sender, request.part)
        while time.monotonic() < deadline and which not in self._inbox.get(key, {}):
            await self._arrived.wait(min(deadline - time.monotonic(), OUTSIDE_RECHECK_S))
            if which not in self._inbox.get(key, {}) and await self._outside_group_now(request.group_id, remote):
                return True
        return False

    @limit_per_peer(swarm_pb2.GatherHeader)
    async def rpc_download_message(
        self, sealed: envelope_pb2.SignedEnvelope, context: P2PContext
    ) -> AsyncIterator[swarm_pb2.Chunk]:
        """Stream the message of `request.sender` for (group, phase) once this worker holds it."""
        header = swarm_pb2.GatherHeader(status=swarm_pb2.STATE_REFUSED)
        opened, header.reason = self._open_request(sealed, swarm_pb2.GatherRequest, context)  # type: ignore[attr-defined]
        if opened is None:
            yield self._head(header, sealed)  # type: ignore[attr-defined]
            return
        request, nonce = opened.message, opened.envelope.nonce
        if (request.run_id, request.config_hash, request.stage) != (self.run_id, self.config_hash, self.stage):
            header.reason = "another run, config or stage"
            yield self._head(header, nonce=nonce)  # type: ignore[attr-defined]
            return
        key, which = (request.group_id, request.phase), (request.sender, request.part)
        if await self._outside_group(request.group_id, context.remote_id) or \
                await self._found_outside_waiting(request, context.remote_id):  # fmt: skip
            header.status, header.reason = swarm_pb2.STATE_LACKING, OUTSIDE  # it will never hold a message of that group
            yield self._head(header, nonce=nonce)  # type: ignore[attr-defined]
            return
        held = self._inbox.get(key, {}).get(which)
        if held is None or (request.sender == self._my_id and request.phase >= REDUCED and injection.armed(
                "withhold_reduced", round=self._current_round, stage=self.stage)):  # fmt: skip
            header.status, header.reason = swarm_pb2.STATE_NOT_READY, "not held here"
            yield self._head(header, nonce=nonce)  # type: ignore[attr-defined]
            return
        blob, digest = held
        if injection.armed("flip_served_bit", stage=self.stage):
            blob = injection.flip_last_bit(blob)
        if request.sender == self._my_id and request.phase >= REDUCED and \
                injection.armed("equivocate_reduced", stage=self.stage):  # fmt: skip
            served = self._equivocated[key] = self._equivocated.get(key, -1) + 1
            blob = injection.flip_middle_bit(blob, served)  # other bytes for each, behind a digest signed for them
            digest = self._sealed_digest(request.group_id, request.phase, request.part, blob)
        self._messages_served += 1
        if injection.armed("cut_served_message", stage=self.stage, serve=self._messages_served):
            blob = blob[: len(blob) // 2]  # then the stream ends, as a connection reset mid-reply reads
        first = swarm_pb2.Chunk(head=digest)  # the author's signed digest: the header of a message sent
        self._served[request.group_id] += first.ByteSize()
        yield first
        for start in range(0, len(blob), PAYLOAD_PART):
            chunk = swarm_pb2.Chunk(payload=blob[start : start + PAYLOAD_PART])
            self._served[request.group_id] += chunk.ByteSize()
            yield chunk
        if request.sender == self._my_id:
            self._delivered[key].add(context.remote_id.to_base58())
            self._pulled_here.notify()
