"""Signed requests and replies between stage workers' averagers, and tensors streamed behind a signed header.

Every request is a SignedEnvelope from the libp2p peer that sends it, addressed to the worker asked, fresh
and never seen before (`SignedReplies._open_request`); every reply starts with a header signed by the
worker that answers, in reply to the request's nonce, holding the SHA-256 of the tensor bytes that follow
(`_head`, `_tensor_chunks`). A reply is read within time and size limits (`read_stream`): a frozen sender
costs one chunk timeout, a reply larger than the stage's tensors can take is refused as soon as it is.
Used by the averages a worker serves (held.py) and the states it serves (state_service.py).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, AsyncIterator  # typing's: hivemind reads rpc handlers' stream hints by their _name

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from .. import injection
from ..errors import WireRejected
from ..proto_gen import envelope_pb2
from ..wire import swarm_pb2
from .request_limits import peer_limits

__all__ = [
    "MAX_WAIT_S", "Oversized", "Reply", "SignedReplies", "claimed_nonce", "limit_per_peer", "read_stream", "same_shapes",
]  # fmt: skip

MAX_WAIT_S = 600.0  # the longest a request may ask a donor to wait


def limit_per_peer(header_cls: type) -> Callable[[Callable], Callable]:
    """A download handler (rpc_download_*) that takes at most REQUESTS_PER_S requests of one peer a second (bursts of
    REQUEST_BURST) and holds at most MAX_HELD_PER_PEER at once (request_limits.py, family "downloads"), and answers
    one more with a signed `header_cls` refusal at once."""

    def wrap(handler: Callable) -> Callable:
        @functools.wraps(handler)  # hivemind reads the handler's argument names and (unwrapped) type hints
        async def limited(self: Any, sealed: envelope_pb2.SignedEnvelope, context: P2PContext) -> AsyncIterator[Any]:
            limits, peer = peer_limits(self), context.remote_id.to_base58()
            reason = limits.refusal("downloads", peer)
            if reason:
                self._refused(f"a request from {peer}", reason)
                yield self._head(header_cls(status=swarm_pb2.STATE_REFUSED, reason=reason), sealed)
                return
            with limits.held("downloads", peer):
                async for chunk in handler(self, sealed, context):
                    yield chunk

        return limited

    return wrap


class SignedReplies:
    """The averager's (DilocoxAverager's) signed side of requests and replies."""
    def _open_request(
        self, sealed: envelope_pb2.SignedEnvelope, cls: type, context: P2PContext
    ) -> tuple[Any, str]:
        """The verified request (fresh, addressed to this worker, from the peer on the stream), or why not."""
        sender = context.remote_id.to_base58()
        try:
            return self.gate.open(sealed, cls, sender=sender, topic=self.signer.worker_id, fresh=True), ""
        except WireRejected as e:
            self._refused(f"a {cls.DESCRIPTOR.name} from {sender}", str(e))
            return None, f"refused: {e}"[:300]

    def _hold_s(self, wait_s: float) -> float:
        """How long a handler holds a request that asks to wait `wait_s`: at most what an honest member ever asks
        (round_wait + allreduce_timeout: a borrow or a pending average after a failed round), MAX_WAIT_S in all.
        A request asking 600 s held its handler 600 s (issue 38, point 4)."""
        limit = self._matchmaking.min_matchmaking_time + self._allreduce_timeout  # round_wait + allreduce_timeout
        return min(max(wait_s, 0.0), limit, MAX_WAIT_S)

    def _stage_request(
        self, sealed: envelope_pb2.SignedEnvelope, cls: type, context: P2PContext, header: Any
    ) -> tuple[Any, bytes, swarm_pb2.Chunk | None]:
        """(the verified request, its nonce, None) if it is of this run, config and stage; else the signed
        refusal to send, `header` (status REFUSED) saying why."""
        opened, header.reason = self._open_request(sealed, cls, context)
        if opened is None:
            return None, b"", self._head(header, sealed)
        request, nonce = opened.message, opened.envelope.nonce
        if (request.run_id, request.config_hash, request.stage) != (self.run_id, self.config_hash, self.stage):
            header.reason = "another run, config or stage"
            return None, nonce, self._head(header, nonce=nonce)
        return request, nonce, None

    def _head(self, header: Any, sealed: envelope_pb2.SignedEnvelope | None = None, *, nonce: bytes = b"") -> swarm_pb2.Chunk:
        """A signed reply header answering `nonce` (or, for a request that was refused, the nonce it claims)."""
        if sealed is not None:
            nonce = claimed_nonce(sealed)
        return swarm_pb2.Chunk(head=self.signer.seal(header, in_reply_to=nonce))

    def _open_head(self, reply: Reply, cls: type, peer: str, request: envelope_pb2.SignedEnvelope) -> Any:
        """The reply's header, signed by `peer` in answer to `request`; raises WireRejected."""
        if not reply.head:
            raise WireRejected("reply without a header")
        return self.gate.open(reply.head, cls, sender=peer, in_reply_to=claimed_nonce(request)).message

    def _tensor_chunks(self, tensors: Sequence[torch.Tensor]) -> tuple[list[swarm_pb2.Chunk], bytes]:
        """Tensor parts to stream, and the SHA-256 of their bytes (for the signed header)."""
        parts = [p.SerializeToString() for t in tensors for p in split_for_streaming(serialize_torch_tensor(t))]
        digest = hashlib.sha256(b"".join(parts)).digest()
        if parts and injection.armed("flip_served_bit", stage=self.stage):
            parts[0] = injection.flip_last_bit(parts[0])
        return [swarm_pb2.Chunk(tensor_part=p) for p in parts], digest

    def _tensor_bytes(self, copies: int) -> int:
        """The most bytes a reply of `copies` copies of this stage's tensors (plus framing) can take."""
        total = sum(t.numel() * t.element_size() for t in self._averaged_tensors)
        return int(copies * total * 1.02) + (1 << 20)

    def _reply_limits(self, wait_s: float, total_s: float) -> dict[str, float]:
        """How long a reply may take: the server's wait plus one chunk timeout for its header, one chunk
        timeout between chunks, `total_s` in all."""
        return dict(first_within=wait_s + self.next_chunk_timeout, each_within=self.next_chunk_timeout, total_within=total_s)


def same_shapes(tensors: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> bool:
    return len(tensors) == len(like) and all(
        t.shape == r.shape and t.dtype == r.dtype for t, r in zip(tensors, like)
    )


def claimed_nonce(sealed: envelope_pb2.SignedEnvelope) -> bytes:
    """The nonce a request says it has (unverified: only echoed back, or compared with our own)."""
    try:
        return envelope_pb2.Envelope.FromString(sealed.body).nonce
    except Exception:
        return b""


class Oversized(ValueError):
    """A reply longer than what this stage's tensors can take: refused before reading more."""


@dataclass
class Reply:
    head: bytes
    tensors: list[torch.Tensor]
    size: int
    sha256: bytes
    """SHA-256 of the tensor parts, end to end, as received."""


async def read_stream(
    stream: AsyncIterator[swarm_pb2.Chunk], *, first_within: float, each_within: float, total_within: float, max_bytes: int
) -> Reply:
    """Collect the header chunk, the tensors that follow it (a part with a dtype starts a new tensor),
    the bytes received and the SHA-256 of the tensor parts. The header must come within `first_within` s
    (the server may wait for what is asked) and every later chunk within `each_within` s of the one
    before, all within `total_within` s: a frozen sender costs one chunk timeout, not the whole budget.
    More than `max_bytes` in all is refused as soon as it is exceeded."""
    head, parts, tensors, size, digest = None, [], [], 0, hashlib.sha256()
    deadline = time.monotonic() + total_within
    chunks = aiter(stream)
    while True:
        within = min(first_within if head is None else each_within, deadline - time.monotonic())
        if within <= 0:
            raise TimeoutError(f"the reply took longer than {total_within:.1f}s")
        try:
            chunk = await asyncio.wait_for(anext(chunks), within)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise TimeoutError(f"no {'header' if head is None else 'next chunk'} within {within:.1f}s") from None
        size += chunk.ByteSize()
        if size > max_bytes:
            raise Oversized(f"the reply exceeds {max_bytes} bytes, more than this stage's tensors can take")
        if head is None:
            head = chunk.head
            continue
        digest.update(chunk.tensor_part)
        part = _tensor_part(chunk.tensor_part)
        if part.dtype and parts:
            tensors.append(_combine(parts))
            parts = []
        parts.append(part)
    if parts:
        tensors.append(_combine(parts))
    return Reply(head or b"", tensors, size, digest.digest())


def _tensor_part(blob: bytes) -> runtime_pb2.Tensor:
    """One streamed part of an uncompressed float32 tensor (all that workers send); WireRejected otherwise."""
    try:
        part = runtime_pb2.Tensor.FromString(blob)
    except Exception as e:
        raise WireRejected(f"a malformed tensor part ({type(e).__name__})") from None
    if not blob or part.compression != runtime_pb2.CompressionType.NONE or part.dtype not in ("", "float32"):
        raise WireRejected("a tensor part that is not uncompressed float32")
    return part


def _combine(parts: list[runtime_pb2.Tensor]) -> torch.Tensor:
    try:
        return deserialize_torch_tensor(combine_from_streaming(parts))
    except Exception as e:  # shapes that do not fit the bytes, a first part without a dtype...
        raise WireRejected(f"tensor parts that do not make a tensor ({type(e).__name__}: {str(e)[:80]})") from None
