"""Signed envelopes: how every message between peers is sealed, and checked before use.

    signer = Signer(worker_key, certificate, admission=None)
    blob = signer.seal(request, topic=donor_id, round=r)          # a request to one worker
    opened = gate.open(blob, swarm_pb2.StateRequest, sender=remote_id, topic=my_id, fresh=True)
    opened.message, opened.envelope.nonce, opened.peer_key

The wire form is a `SignedEnvelope`: an `Envelope` (protocol version, run id, payload type,
topic, round, nonce, reply-to, send time, payload, the sender's StageCertificate and, in
closed runs, its RunCertificate), serialized, and the stage worker's Ed25519 signature over
exactly those bytes. The signer is named by its libp2p peer id, which *is* its public key
(identity.py): a record stored under a worker's peer id, or a request arriving on a libp2p
stream from it, verifies against that id and nothing else.

`Gate.open` refuses, with `WireRejected` naming the reason, in this order: not bytes or
over the size limit (before anything is parsed), malformed, another protocol version or
run, an unexpected payload type, a signer other than the expected sender, a bad worker
certificate or signature, a banned peer, a key the run does not admit, the wrong topic,
round or reply, a stale or replayed request, and a payload that fails `wire.decode`.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError, Message

from .errors import WireRejected
from .identity import peer_id_of, public_key_of, verify_run_certificate, verify_worker_certificate
from .proto_gen import envelope_pb2
from .wire import MAX_RECORD_BYTES, decode, protocol_version

__all__ = ["ForeignProtocol", "Gate", "Opened", "Policy", "Signer"]

REQUEST_MAX_AGE_S = 300.0  # a request older than this (by the sender's clock) is refused
NONCES_KEPT = 65536  # requests remembered for replay detection (their age limit bounds the need)
SIGNATURES_KEPT = 8192  # good signatures remembered (Gate._check_signature): a few rounds of every record
M = TypeVar("M", bound=Message)


class ForeignProtocol(WireRejected):
    """An envelope of another protocol version (a peer running other code)."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


@dataclass(frozen=True)
class Opened(Generic[M]):
    """A verified envelope and its decoded payload."""

    envelope: envelope_pb2.Envelope
    message: M
    sender: str
    """The signing stage worker's peer id."""

    @property
    def peer_key(self) -> bytes:
        return self.envelope.sender.peer_key

    @property
    def peer_name(self) -> str:
        return self.envelope.sender.peer_name


class Signer:
    """Seals messages as one stage worker (its libp2p key), vouched for by its peer's certificate."""

    def __init__(
        self,
        worker_key: Ed25519PrivateKey,
        certificate: envelope_pb2.StageCertificate,
        admission: envelope_pb2.RunCertificate | None = None,
    ):
        self.worker_key, self.certificate, self.admission = worker_key, certificate, admission
        self.worker_id = peer_id_of(worker_key)
        if certificate.worker_id != self.worker_id:
            raise ValueError("the stage certificate names another worker key")
        self.run_id = certificate.run_id

    def seal(self, message: Message, *, topic: str = "", round: int = 0, in_reply_to: bytes = b"") -> bytes:
        return self.seal_message(message, topic=topic, round=round, in_reply_to=in_reply_to).SerializeToString()

    def seal_message(
        self, message: Message, *, topic: str = "", round: int = 0, in_reply_to: bytes = b""
    ) -> envelope_pb2.SignedEnvelope:
        """As `seal`, the SignedEnvelope itself (an RPC request)."""
        envelope = envelope_pb2.Envelope(
            protocol=protocol_version(),
            run_id=self.run_id,
            type=message.DESCRIPTOR.full_name,
            topic=topic,
            round=round,
            nonce=os.urandom(16),
            in_reply_to=in_reply_to,
            sent_at=time.time(),
            payload=message.SerializeToString(),
            sender=self.certificate,
        )
        if self.admission is not None:
            envelope.admission.CopyFrom(self.admission)
        body = envelope.SerializeToString()
        return envelope_pb2.SignedEnvelope(body=body, signature=self.worker_key.sign(body))


@dataclass(frozen=True)
class Policy:
    """Who the run admits. Open: any peer key (with a valid signature). Closed: keys on the allowlist,
    or keys holding a RunCertificate signed by the run key."""

    run_id: str
    closed: bool = False
    allowlist: frozenset[bytes] = frozenset()
    run_key: bytes = b""

    def refusal(self, envelope: envelope_pb2.Envelope) -> str:
        """Why the run does not admit the envelope's sender ("" if it does)."""
        if not self.closed:
            return ""
        key = envelope.sender.peer_key
        if key in self.allowlist:
            return ""
        if not envelope.HasField("admission"):
            return f"peer key {key.hex()[:16]}... is not on this closed run's allowlist and holds no certificate"
        cert = envelope.admission
        if cert.peer_key != key or cert.run_id != self.run_id or not verify_run_certificate(cert, self.run_key):
            return f"peer key {key.hex()[:16]}... holds a certificate this run's key did not sign for it"
        return ""


@dataclass
class Gate:
    """Checks envelopes for one stage worker; remembers request nonces and banned peers."""

    policy: Policy
    banned: set[str] = field(default_factory=set)
    banned_keys: set[bytes] = field(default_factory=set)
    """Peer keys banned with a worker of theirs: every worker they certify is refused (one key, one ban)."""
    _nonces: collections.OrderedDict[bytes, None] = field(default_factory=collections.OrderedDict)
    # signatures found good: (signer, signature, sha256 of the body). A record read again (every poll of the DHT
    # returns the same ones) skips its Ed25519 check, 0.2 ms of CPU each on a slow core
    _good: collections.OrderedDict[tuple[str, bytes, bytes], None] = field(default_factory=collections.OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open(
        self,
        blob: object,
        cls: type[M] | tuple[type[Message], ...],
        *,
        sender: str | None = None,
        topic: str | None = None,
        round: int | Collection[int] | None = None,
        in_reply_to: bytes | None = None,
        fresh: bool = False,
        max_bytes: int = MAX_RECORD_BYTES,
        even_banned: bool = False,
    ) -> Opened[M]:
        """Verify `blob` and decode its payload as `cls` (or as whichever of a tuple of classes it holds); raise
        WireRejected with the reason. With `even_banned`, a banned sender's envelope is opened too (a group
        it is already in)."""
        envelope, signer = self._verify(blob, max_bytes, sender, even_banned=even_banned)
        classes = cls if isinstance(cls, tuple) else (cls,)
        cls = next((c for c in classes if c.DESCRIPTOR.full_name == envelope.type), None)
        if cls is None:
            expected = " or ".join(c.DESCRIPTOR.name for c in classes)
            raise WireRejected(f"expected a {expected}, got a {envelope.type[:60]!r} from {_short(signer)}")
        if topic is not None and envelope.topic != topic:
            raise WireRejected(f"{cls.DESCRIPTOR.name} from {_short(signer)} is addressed to {envelope.topic[:60]!r}, "
                               f"not {topic[:60]!r} (replayed or misdirected)")  # fmt: skip
        if round is not None and not (envelope.round in round if isinstance(round, Collection) else envelope.round == round):
            raise WireRejected(f"{cls.DESCRIPTOR.name} from {_short(signer)} is about round {envelope.round}, "
                               f"outside the window this worker accepts (replayed or stale)")  # fmt: skip
        if in_reply_to is not None and envelope.in_reply_to != in_reply_to:
            raise WireRejected(f"{cls.DESCRIPTOR.name} from {_short(signer)} answers another request (replayed)")
        if fresh:
            self._check_fresh(envelope, signer)
        return Opened(envelope, decode(cls, envelope.payload, max_bytes=max_bytes), signer)

    def check(
        self, blob: object, *, sender: str | None = None, max_bytes: int = MAX_RECORD_BYTES, any_protocol: bool = False
    ) -> envelope_pb2.Envelope:
        """Verify signature, sender, run and admission (and unless `any_protocol`, the version); any payload type."""
        return self._verify(blob, max_bytes, sender, any_protocol=any_protocol)[0]

    def ban(self, peer_ids: Collection[str], keys: Collection[bytes] = ()) -> None:
        """Refuse these workers' envelopes, and every worker's whose certificate names one of `keys`."""
        with self._lock:
            self.banned.update(peer_ids)
            self.banned_keys.update(bytes(k) for k in keys)

    def _verify(
        self, blob: object, max_bytes: int, sender: str | None, *, any_protocol: bool = False, even_banned: bool = False
    ) -> tuple[envelope_pb2.Envelope, str]:
        signed, envelope = envelope_pb2.SignedEnvelope(), envelope_pb2.Envelope()
        if isinstance(blob, envelope_pb2.SignedEnvelope):  # an RPC request, parsed by hivemind (within p2pd's limit)
            signed, blob = blob, b""
            size = signed.ByteSize()
        elif isinstance(blob, bytes):
            size = len(blob)
        else:
            raise WireRejected(f"expected a signed envelope (bytes), got {type(blob).__name__}")
        if size > max_bytes + 4096:
            raise WireRejected(f"message of {size} bytes > limit {max_bytes + 4096}: refused before parsing")
        try:
            if blob:
                signed.ParseFromString(blob)
            envelope.ParseFromString(signed.body)
        except DecodeError as e:
            raise WireRejected(f"malformed envelope ({e})") from None
        if envelope.protocol != protocol_version() and not any_protocol:
            raise ForeignProtocol(f"protocol version {envelope.protocol} from {_short(envelope.sender.worker_id)}: this "
                                  f"peer speaks version {protocol_version()} (run the same dilocox-p2p release)",
                                  envelope.protocol)  # fmt: skip
        if envelope.run_id != self.policy.run_id:
            raise WireRejected(f"envelope of run {envelope.run_id[:60]!r}, not {self.policy.run_id!r}")
        signer = envelope.sender.worker_id
        if sender is not None and signer != sender:
            raise WireRejected(f"signed as {_short(signer)} but sent by {_short(sender)} (a record or message "
                               "claimed by the wrong key)")  # fmt: skip
        if envelope.sender.run_id != self.policy.run_id or not verify_worker_certificate(envelope.sender):
            raise WireRejected(f"the worker certificate of {_short(signer)} is not signed by the peer key it names")
        self._check_signature(signer, signed)
        if signer in self.banned and not even_banned:
            raise WireRejected(f"{_short(signer)} is banned for this run")
        if bytes(envelope.sender.peer_key) in self.banned_keys and not even_banned:
            raise WireRejected(f"{_short(signer)} is banned for this run (the peer key that certifies it is)")
        refusal = self.policy.refusal(envelope)
        if refusal:
            raise WireRejected(f"{_short(signer)} (peer {envelope.sender.peer_name[:40]!r}) not admitted: {refusal}")
        return envelope, signer

    def _check_signature(self, signer: str, signed: envelope_pb2.SignedEnvelope) -> None:
        good = (signer, signed.signature, hashlib.sha256(signed.body).digest())
        with self._lock:
            if good in self._good:
                return
        try:
            public_key_of(signer).verify(signed.signature, signed.body)
        except (InvalidSignature, ValueError) as e:
            raise WireRejected(f"bad signature by {_short(signer)} ({type(e).__name__})") from None
        with self._lock:
            self._good[good] = None
            while len(self._good) > SIGNATURES_KEPT:
                self._good.popitem(last=False)

    def _check_fresh(self, envelope: envelope_pb2.Envelope, signer: str) -> None:
        if not math.isfinite(envelope.sent_at) or abs(time.time() - envelope.sent_at) > REQUEST_MAX_AGE_S:
            raise WireRejected(f"request from {_short(signer)} sent {time.time() - envelope.sent_at:+.0f}s ago: "
                               f"outside +-{REQUEST_MAX_AGE_S:.0f}s (replayed, or a clock far off)")  # fmt: skip
        with self._lock:
            if envelope.nonce in self._nonces or len(envelope.nonce) != 16:
                raise WireRejected(f"request from {_short(signer)} replayed (nonce seen before)")
            self._nonces[envelope.nonce] = None
            while len(self._nonces) > NONCES_KEPT:
                self._nonces.popitem(last=False)


def _short(peer_id: str) -> str:
    return f"{peer_id[:20]}..." if len(peer_id) > 20 else peer_id or "?"
