"""Who a peer is: Ed25519 keys, the libp2p identities of its stage workers, and certificates.

    peer key      the operator's identity (`dilocox-peer keygen`, `join --identity FILE`): a PEM
                  file, mode 0600; without --identity one is made in the run directory and kept.
    worker key    one per stage worker: its libp2p identity (p2pd's key file), so its peer id
                  *is* its public key (an Ed25519 "identity" peer id, 12D3KooW...). A signature by
                  it is checked against the peer id alone, and libp2p authenticates the same key
                  on every connection.
    certificates  the peer key signs each worker key (StageCertificate: nobody can speak for a
                  peer without its key); in closed runs the run key signs the peer key
                  (RunCertificate, `dilocox-peer certify`).

Keys on disk that others can read are refused: a copied key is a stolen identity.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import IdentityError
from .proto_gen import envelope_pb2
from .proto_gen import libp2p_keys_pb2  # libp2p's key messages (hivemind's crypto.proto), without importing hivemind

__all__ = [
    "certify_peer",
    "certify_worker",
    "check_worker_key",
    "load_identity",
    "load_run_certificate",
    "peer_id_of",
    "public_key_of",
    "public_raw",
    "run_identity",
    "verify_run_certificate",
    "verify_worker_certificate",
    "worker_identity",
    "write_identity",
]

_IDENTITY_MULTIHASH = b"\x00\x24"  # multihash code 0 (identity), length 36: a marshalled Ed25519 PublicKey


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of a public key (what certificates and allowlists name, in hex)."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# ----- peer keys (PEM) -------------------------------------------------------------------------
def write_identity(path: Path) -> Ed25519PrivateKey:
    """Create a new key at `path` (mode 0600); an existing file is never overwritten."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise IdentityError(f"{path} already exists: refusing to overwrite a key (move it away first)") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key


def load_identity(path: Path) -> Ed25519PrivateKey:
    """Load a peer key, refusing one that others can read or that is not an Ed25519 PEM key."""
    try:
        _refuse_if_shared(path, "identity")
    except FileNotFoundError:
        raise IdentityError(f"identity {path} does not exist: create one with `dilocox-peer keygen --out {path}`") from None
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise IdentityError(f"identity {path} is not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"identity {path} holds a {type(key).__name__}; dilocox-peer keys are Ed25519")
    return key


def _refuse_if_shared(path: Path, what: str) -> None:
    """IdentityError if anyone but its owner may read or write the key at `path` (FileNotFoundError if absent)."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityError(
            f"{what} {path} is readable by others (mode {stat.S_IMODE(mode):04o}): a copied key is a stolen "
            f"identity. Fix it with `chmod 600 {path}`"
        )


def run_identity(run_dir: Path) -> Ed25519PrivateKey:
    """This run directory's peer key: made on first use, reused on restart."""
    path = run_dir / "identity" / "peer.pem"
    return load_identity(path) if path.exists() else write_identity(path)


# ----- worker keys (libp2p) --------------------------------------------------------------------
def check_worker_key(path: Path) -> None:
    """IdentityError (with the fix) if the worker key at `path` exists and others can read it; nothing if absent."""
    if path.exists():
        _refuse_if_shared(path, "worker key")


def worker_identity(path: Path) -> Ed25519PrivateKey:
    """A stage worker's libp2p key, in p2pd's file format (`-id`): made on first use, reused on restart."""
    if path.exists():
        _refuse_if_shared(path, "worker key")  # it signs every envelope of its stage: as secret as the peer key
        try:
            stored = libp2p_keys_pb2.PrivateKey.FromString(path.read_bytes())
        except Exception as e:
            raise IdentityError(f"worker key {path} is unreadable ({e!r}): delete it to make a new one") from None
        if stored.key_type != libp2p_keys_pb2.KEY_ED25519 or len(stored.data) != 64:
            raise IdentityError(f"worker key {path} is not an Ed25519 libp2p key: delete it to make a new one")
        return Ed25519PrivateKey.from_private_bytes(stored.data[:32])
    key = Ed25519PrivateKey.generate()
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    blob = libp2p_keys_pb2.PrivateKey(key_type=libp2p_keys_pb2.KEY_ED25519, data=seed + public_raw(key)).SerializeToString()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    return key


def peer_id_of(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The libp2p peer id (base58) of an Ed25519 key: the identity multihash of its marshalled public key."""
    marshalled = libp2p_keys_pb2.PublicKey(key_type=libp2p_keys_pb2.KEY_ED25519, data=public_raw(key)).SerializeToString()
    return base58.b58encode(_IDENTITY_MULTIHASH + marshalled).decode()


@functools.lru_cache(maxsize=4096)
def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 key a peer id names; ValueError for any other kind of peer id (RSA, hashed...)."""
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raise ValueError(f"{peer_id[:20]!r} is not a base58 peer id") from None
    if not raw.startswith(_IDENTITY_MULTIHASH) or len(raw) != 38:
        raise ValueError(f"peer id {peer_id[:20]}... is not an Ed25519 identity peer id")
    marshalled = libp2p_keys_pb2.PublicKey()
    try:
        marshalled.ParseFromString(raw[2:])
    except Exception:
        raise ValueError(f"peer id {peer_id[:20]}... does not hold a public key") from None
    if marshalled.key_type != libp2p_keys_pb2.KEY_ED25519 or len(marshalled.data) != 32:
        raise ValueError(f"peer id {peer_id[:20]}... is not an Ed25519 identity peer id")
    return Ed25519PublicKey.from_public_bytes(marshalled.data)


# ----- certificates ----------------------------------------------------------------------------
def _signed_body(cert: envelope_pb2.StageCertificate | envelope_pb2.RunCertificate) -> bytes:
    body = type(cert)()
    body.CopyFrom(cert)
    body.signature = b""
    return body.SerializeToString(deterministic=True)


def certify_worker(
    peer_key: Ed25519PrivateKey, worker_id: str, *, run_id: str, stage: int, peer_name: str
) -> envelope_pb2.StageCertificate:
    cert = envelope_pb2.StageCertificate(
        peer_key=public_raw(peer_key), worker_id=worker_id, run_id=run_id, stage=stage, peer_name=peer_name
    )
    cert.signature = peer_key.sign(_signed_body(cert))
    return cert


def certify_peer(run_key: Ed25519PrivateKey, peer_key: bytes, *, run_id: str, note: str = "") -> envelope_pb2.RunCertificate:
    if len(peer_key) != 32:
        raise IdentityError(f"a peer key is 32 bytes (64 hex digits), got {len(peer_key)} bytes")
    cert = envelope_pb2.RunCertificate(peer_key=peer_key, run_id=run_id, note=note)
    cert.signature = run_key.sign(_signed_body(cert))
    return cert


@functools.lru_cache(maxsize=4096)
def _verified(body: bytes, signature: bytes, key: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(key).verify(signature, body)
        return True
    except (InvalidSignature, ValueError):
        return False


def verify_worker_certificate(cert: envelope_pb2.StageCertificate) -> bool:
    """The certificate is signed by the peer key it names (verdicts cached: one check per worker)."""
    return len(cert.peer_key) == 32 and _verified(_signed_body(cert), cert.signature, cert.peer_key)


def verify_run_certificate(cert: envelope_pb2.RunCertificate, run_key: bytes) -> bool:
    return len(run_key) == 32 and _verified(_signed_body(cert), cert.signature, run_key)


def load_run_certificate(path: Path) -> envelope_pb2.RunCertificate:
    """A certificate file written by `dilocox-peer certify`."""
    try:
        return envelope_pb2.RunCertificate.FromString(path.read_bytes())
    except FileNotFoundError:
        raise IdentityError(f"certificate {path} does not exist") from None
    except Exception as e:
        raise IdentityError(f"certificate {path} is not a dilocox-peer certificate ({e!r})") from None
