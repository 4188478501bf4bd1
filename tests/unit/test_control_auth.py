"""Who a peer's control plane serves (dilocox_p2p/control_auth.py): this machine as it comes, other hosts only
with a fresh signature by a listed operator key, each refusal with its reason.

The gate is fed what gRPC hands the interceptor (method, request bytes, `context.peer()`, metadata); the same
requests over real sockets from another host are in tests/netns/test_remote_control.py."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dilocox_p2p.config import load_config
from dilocox_p2p.control_auth import MAX_SKEW_S, METADATA_KEY, ControlGate, is_loopback_peer, signed_metadata
from dilocox_p2p.errors import ConfigError
from dilocox_p2p.identity import public_raw
from dilocox_p2p.proto_gen import control_pb2, envelope_pb2

pytestmark = pytest.mark.unit

GET = "/dilocox.v1.PeerControl/GetStatus"
WATCH = "/dilocox.v1.PeerControl/Watch"
REMOTE = "ipv4:203.0.113.9:50122"
OPERATOR = Ed25519PrivateKey.generate()
REQUEST = control_pb2.StatusRequest()


def _gate(now: float | None = None) -> ControlGate:
    if now is None:
        return ControlGate([public_raw(OPERATOR)])
    return ControlGate([public_raw(OPERATOR)], clock=lambda: now)


def _ask(gate: ControlGate, metadata=(), *, method: str = GET, request=REQUEST, peer: str = REMOTE) -> str:
    return gate.refusal(method, request.SerializeToString(deterministic=True), peer, metadata)


@pytest.mark.parametrize("peer", ["ipv4:127.0.0.1:5000", "ipv4:127.8.9.1:1", "ipv6:[::1]:5000", "unix:/tmp/s",
                                  "ipv6:[::ffff:127.0.0.1]:7"])  # fmt: skip
def test_a_request_from_this_machine_is_served_without_a_signature(peer):
    assert is_loopback_peer(peer)
    assert _ask(_gate(), peer=peer) == ""


@pytest.mark.parametrize("peer", [REMOTE, "ipv4:10.0.0.2:1", "ipv6:[2001:db8::1]:9", "ipv6:[::ffff:10.0.0.1]:7", "?"])
def test_a_request_from_another_host_needs_a_signature(peer):
    assert not is_loopback_peer(peer)
    assert "carries no operator signature" in _ask(_gate(), peer=peer)
    assert "lists no control.operator_keys" in ControlGate([]).refusal(GET, b"", peer, ())


def test_a_listed_operators_signed_request_is_served_once_and_its_replay_refused():
    gate, metadata = _gate(), signed_metadata(OPERATOR, GET, REQUEST)
    assert _ask(gate, metadata) == ""
    assert "replayed" in _ask(gate, metadata)
    assert _ask(gate, signed_metadata(OPERATOR, GET, REQUEST)) == ""  # a new signature is a new request
    watch = control_pb2.WatchRequest(include_current=True)
    assert _ask(gate, signed_metadata(OPERATOR, WATCH, watch), method=WATCH, request=watch) == ""


def test_an_unlisted_key_is_refused_though_its_signature_is_good():
    stranger = Ed25519PrivateKey.generate()
    assert "is not in control.operator_keys" in _ask(_gate(), signed_metadata(stranger, GET, REQUEST))


def test_a_signed_request_altered_on_the_way_is_refused():
    gate = _gate()
    signed = envelope_pb2.SignedEnvelope.FromString(signed_metadata(OPERATOR, GET, REQUEST)[0][1])
    flipped = bytearray(signed.body)
    flipped[-1] ^= 1  # a bit of the signed body: the operator's key itself, last byte
    body_flip = envelope_pb2.SignedEnvelope(body=bytes(flipped), signature=signed.signature).SerializeToString()
    assert _ask(gate, [(METADATA_KEY, body_flip)]) != ""
    signature_flip = envelope_pb2.SignedEnvelope(body=signed.body, signature=bytes([signed.signature[0] ^ 1]) +
                                                 signed.signature[1:]).SerializeToString()  # fmt: skip
    assert "does not verify" in _ask(gate, [(METADATA_KEY, signature_flip)])
    # a good signature used for another method, or for another request than the one signed
    watch = control_pb2.WatchRequest(include_current=True)
    assert "another method, request" in _ask(gate, signed_metadata(OPERATOR, GET, REQUEST), method=WATCH, request=watch)
    assert "another method, request" in _ask(gate, signed_metadata(OPERATOR, WATCH, control_pb2.WatchRequest()),
                                             method=WATCH, request=watch)  # fmt: skip
    assert "malformed" in _ask(gate, [(METADATA_KEY, b"\xff\x01not a protobuf")])


def test_a_request_signed_too_long_ago_or_ahead_is_refused():
    metadata = signed_metadata(OPERATOR, GET, REQUEST)
    sent = envelope_pb2.Envelope.FromString(envelope_pb2.SignedEnvelope.FromString(metadata[0][1]).body).sent_at
    assert "from this peer's clock" in _ask(_gate(now=sent + MAX_SKEW_S + 1), metadata)
    assert "from this peer's clock" in _ask(_gate(now=sent - MAX_SKEW_S - 1), metadata)
    assert _ask(_gate(now=sent + MAX_SKEW_S - 1), metadata) == ""


def test_the_health_service_answers_anyone():
    assert _ask(_gate(), method="/grpc.health.v1.Health/Check") == ""


def test_an_operator_key_that_is_not_a_public_key_in_hex_is_a_config_error():
    with pytest.raises(ConfigError, match="control.operator_keys.*64 hex digits"):
        load_config(overrides={"control.operator_keys": ["not-hex"]})
    with pytest.raises(ConfigError, match="64 hex digits"):
        load_config(overrides={"control.operator_keys": ["abcd"]})
    cfg = load_config(overrides={"control.operator_keys": [public_raw(OPERATOR).hex()]})
    assert cfg.control.operator_keys == (public_raw(OPERATOR).hex(),)
