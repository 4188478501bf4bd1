"""Who may ask a peer's control plane: anyone on this machine, and the operators whose keys its config lists.

    key = load_identity(Path("operator.key"))                # `dilocox-peer keygen --out operator.key`
    stub.GetStatus(request, metadata=signed_metadata(key, "/dilocox.v1.PeerControl/GetStatus", request))

PeerControl (control.py) tells a peer's run id, addresses, losses and state hashes. A request from
loopback (the local CLI, a sidecar in the same network namespace) is served as it comes. A request
from any other address must carry, in the gRPC metadata `dilocox-signed-bin`, a SignedEnvelope
(proto/dilocox/v1/envelope.proto) signed by an Ed25519 key listed in `control.operator_keys`: its
Envelope names the method (`type`), holds the request's bytes (`payload`), a fresh 16-byte nonce and
the send time, and `sender.peer_key` is the operator's public key. Everything else from another host
is refused, with the reason, and counted (`control_refused`): no signature, a malformed one, a key
not listed, a bad signature, a signature for another method or request (tampered on the way), a
send time more than MAX_SKEW_S from this clock, or a nonce this peer has already served (replayed).

The standard grpc.health.v1 service on the same port answers anyone: it tells SERVING or not, which
load balancers and container probes on other hosts ask for.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError, Message

from .identity import public_raw
from .proto_gen import envelope_pb2
from .wire import protocol_version

__all__ = ["METADATA_KEY", "MAX_SKEW_S", "ControlGate", "ControlInterceptor", "is_loopback_peer", "signed_metadata"]

logger = logging.getLogger(__name__)

METADATA_KEY = "dilocox-signed-bin"  # "-bin": gRPC carries the value as bytes
MAX_SKEW_S = 60.0
"""A signed request sent (by its signer's clock) further than this from now is refused; a nonce is remembered as
long as its request could still pass, so a replay is refused in every case."""
NONCES_KEPT = 100_000  # signed requests remembered within 2 x MAX_SKEW_S; beyond it, new ones are refused
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def signed_metadata(key: Ed25519PrivateKey, method: str, request: Message) -> tuple[tuple[str, bytes], ...]:
    """The gRPC metadata that lets operator `key` call `method` (e.g. "/dilocox.v1.PeerControl/GetStatus") with
    `request` on a peer at another host; good for one call."""
    envelope = envelope_pb2.Envelope(
        protocol=protocol_version(), type=method, nonce=os.urandom(16), sent_at=time.time(),
        payload=request.SerializeToString(deterministic=True),
        sender=envelope_pb2.StageCertificate(peer_key=public_raw(key)),
    )  # fmt: skip
    body = envelope.SerializeToString()
    return ((METADATA_KEY, envelope_pb2.SignedEnvelope(body=body, signature=key.sign(body)).SerializeToString()),)


def is_loopback_peer(peer: str) -> bool:
    """Whether gRPC's `context.peer()` ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:...") is this machine."""
    kind, _, rest = peer.partition(":")
    if kind in ("unix", "unix-abstract"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]") if kind in ("ipv4", "ipv6") else ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


class ControlGate:
    """Decides on each control request (module docstring); `refusal` says why one is refused ("" to serve it)."""

    def __init__(self, operator_keys: Collection[bytes], *, clock: Callable[[], float] = time.time):
        self.keys = {bytes(k): Ed25519PublicKey.from_public_bytes(bytes(k)) for k in operator_keys}
        self.clock = clock
        self._nonces: dict[bytes, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def refusal(self, method: str, request: bytes, peer: str, metadata: Collection[tuple[str, Any]]) -> str:
        if method.startswith(OPEN_SERVICES) or is_loopback_peer(peer):
            return ""
        blob = next((value for key, value in metadata if key == METADATA_KEY), None)
        if blob is None:
            hint = "" if self.keys else " (this peer lists no control.operator_keys: only loopback is served)"
            return f"a request from another host carries no operator signature{hint}"
        try:
            signed = envelope_pb2.SignedEnvelope.FromString(blob)
            envelope = envelope_pb2.Envelope.FromString(signed.body)
        except DecodeError:
            return "the operator signature is malformed"
        key = self.keys.get(envelope.sender.peer_key)
        if key is None:
            return f"operator key {envelope.sender.peer_key.hex()[:16]}... is not in control.operator_keys"
        try:
            key.verify(signed.signature, signed.body)
        except InvalidSignature:
            return "the operator signature does not verify"
        if envelope.protocol != protocol_version() or envelope.type != method or envelope.payload != request:
            return "the signature was made for another method, request or protocol version"
        now = self.clock()
        if not abs(now - envelope.sent_at) <= MAX_SKEW_S:
            return f"the request was signed {now - envelope.sent_at:+.0f} s from this peer's clock (at most {MAX_SKEW_S:.0f})"
        return self._first_use(envelope.nonce, now)

    def _first_use(self, nonce: bytes, now: float) -> str:
        if len(nonce) != 16:
            return "the signed request's nonce is not 16 bytes"
        with self._lock:
            if len(self._nonces) >= NONCES_KEPT:
                self._nonces = {n: until for n, until in self._nonces.items() if until > now}
            if nonce in self._nonces:
                return "the signed request was replayed (its nonce was served already)"
            if len(self._nonces) >= NONCES_KEPT:
                return "too many signed requests in the last two minutes"
            self._nonces[nonce] = now + 2 * MAX_SKEW_S
        return ""


class ControlInterceptor(grpc.ServerInterceptor):
    """Applies `gate` to every call before its handler runs; a refusal aborts the call (PERMISSION_DENIED, or
    UNAUTHENTICATED without a signature) and is reported to `refused(reason, peer)`."""

    def __init__(self, gate: ControlGate, refused: Callable[[str, str], None]):
        self.gate, self.refused = gate, refused

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler  # our services take one request per call; nothing else is served
        method, metadata = details.method, tuple(details.invocation_metadata or ())
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, kind)

        def checked(request: Any, context: Any) -> Any:
            reason = self.gate.refusal(method, request.SerializeToString(deterministic=True), context.peer(), metadata)
            if reason:
                self.refused(reason, context.peer())
                code = grpc.StatusCode.UNAUTHENTICATED if "no operator signature" in reason else grpc.StatusCode.PERMISSION_DENIED
                context.abort(code, f"refused: {reason}")
            return behavior(request, context)

        wrap = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        return wrap(checked, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)  # fmt: skip


def operator_keys_from_hex(texts: Collection[str], *, flag: str) -> tuple[bytes, ...]:
    """Raw 32-byte public keys from hex (as `dilocox-peer keygen` prints them); ValueError naming the bad one."""
    keys = []
    for text in texts:
        try:
            raw = bytes.fromhex(text)
            Ed25519PublicKey.from_public_bytes(raw)
        except ValueError:
            raise ValueError(f"{flag}: {text[:70]!r} is not an Ed25519 public key in hex (64 hex digits, as "
                             "`dilocox-peer keygen` prints it)") from None  # fmt: skip
        keys.append(raw)
    return tuple(keys)
