"""Signed envelopes, identities and the DHT's record validator, as specifications.

Every way `Gate.open` refuses an envelope is one test here, asserting the reason it gives;
then identity keys and certificates, closed-run admission, and `EnvelopeValidator`.

    pytest tests/unit/test_envelope.py -q
"""

from __future__ import annotations

import os
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from dilocox_p2p import identity
from dilocox_p2p.envelope import REQUEST_MAX_AGE_S, ForeignProtocol, Gate, Opened, Policy, Signer
from dilocox_p2p.errors import IdentityError, WireRejected
from dilocox_p2p.proto_gen import envelope_pb2
from dilocox_p2p.swarm.dht import EnvelopeValidator, run_keys
from dilocox_p2p.wire import PROTOCOL_VERSION, swarm_pb2

pytestmark = pytest.mark.unit

RUN = "r"
RECORD = swarm_pb2.RoundRecord(boundary=7, state_hash="ab" * 32, group_size=3, coverage=1.0)
REQUEST = swarm_pb2.StateRequest(run_id=RUN, config_hash="cd" * 32, stage=0, boundary=7, wait_s=1.0)


@pytest.fixture
def keys(tmp_path):
    """A stage worker's libp2p key and its peer's identity key (named "t")."""
    return identity.worker_identity(tmp_path / "w.key"), identity.write_identity(tmp_path / "p.pem")


def _signer(worker_key, peer_key, *, run_id=RUN, peer_name="t", admission=None) -> Signer:
    cert = identity.certify_worker(peer_key, identity.peer_id_of(worker_key), run_id=run_id, stage=0, peer_name=peer_name)
    return Signer(worker_key, cert, admission)


@pytest.fixture
def signer(keys) -> Signer:
    return _signer(*keys)


@pytest.fixture
def gate() -> Gate:
    return Gate(Policy(run_id=RUN))


def _resign(signer: Signer, blob: bytes, **changes) -> bytes:
    """`blob` with envelope fields changed, signed again by the same worker key (a sender's own doing)."""
    envelope = envelope_pb2.Envelope.FromString(envelope_pb2.SignedEnvelope.FromString(blob).body)
    for name, value in changes.items():
        setattr(envelope, name, value)
    body = envelope.SerializeToString()
    return envelope_pb2.SignedEnvelope(body=body, signature=signer.worker_key.sign(body)).SerializeToString()


def _flip_bit(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1 :]


# ----- what is accepted ------------------------------------------------------------------------
def test_a_valid_envelope_round_trips_message_sender_peer_key_and_peer_name(signer, gate, keys):
    blob = signer.seal(RECORD, topic="k", round=7)
    opened = gate.open(blob, swarm_pb2.RoundRecord, sender=signer.worker_id, topic="k", round=7)
    assert isinstance(opened, Opened)
    assert opened.message == RECORD
    assert opened.sender == signer.worker_id == identity.peer_id_of(keys[0])
    assert opened.peer_key == identity.public_raw(keys[1])
    assert opened.peer_name == "t"
    assert opened.envelope.protocol == PROTOCOL_VERSION and opened.envelope.run_id == RUN


def test_a_request_parsed_by_the_rpc_layer_opens_like_its_bytes(signer, gate):
    sealed = signer.seal_message(REQUEST, topic="me", round=7)
    opened = gate.open(sealed, swarm_pb2.StateRequest, sender=signer.worker_id, topic="me", round=7, fresh=True)
    assert opened.message == REQUEST


def test_a_round_within_the_accepted_window_is_accepted(signer, gate):
    blob = signer.seal(RECORD, topic="k", round=7)
    assert gate.open(blob, swarm_pb2.RoundRecord, round={6, 7, 8}).message == RECORD


def test_a_reply_answering_this_request_is_accepted(signer, gate):
    nonce = os.urandom(16)
    blob = signer.seal(swarm_pb2.StateHeader(status=swarm_pb2.STATE_OK), in_reply_to=nonce)
    assert gate.open(blob, swarm_pb2.StateHeader, in_reply_to=nonce).envelope.in_reply_to == nonce


# ----- what is refused, and why ----------------------------------------------------------------
def test_a_record_signed_by_a_key_other_than_its_sender_is_refused(signer, gate, tmp_path):
    other = identity.peer_id_of(identity.worker_identity(tmp_path / "other.key"))
    blob = signer.seal(RECORD, topic="k", round=7)
    with pytest.raises(WireRejected, match="signed as .* but sent by .*claimed by the wrong key"):
        gate.open(blob, swarm_pb2.RoundRecord, sender=other)


def test_a_signature_with_one_bit_flipped_is_refused(signer, gate):
    signed = signer.seal_message(RECORD, topic="k")
    signed.signature = _flip_bit(signed.signature, 5)
    with pytest.raises(WireRejected, match="bad signature by .*InvalidSignature"):
        gate.open(signed.SerializeToString(), swarm_pb2.RoundRecord, sender=signer.worker_id)


def test_a_payload_with_one_bit_flipped_in_the_signed_body_is_refused(signer, gate):
    signed = signer.seal_message(RECORD, topic="k")
    at = signed.body.find(RECORD.SerializeToString()) + 3  # inside the payload: the body still parses
    signed.body = _flip_bit(signed.body, at)
    with pytest.raises(WireRejected, match="bad signature"):
        gate.open(signed.SerializeToString(), swarm_pb2.RoundRecord, sender=signer.worker_id)


def test_a_signature_found_good_once_vouches_for_its_own_body_only(signer, gate):
    # good signatures are remembered (a record polled again is not checked again): what is remembered must not let
    # the same signature through with another body, or a flipped signature with the same body
    signed = signer.seal_message(RECORD, topic="k")
    for _ in range(2):
        assert gate.open(signed.SerializeToString(), swarm_pb2.RoundRecord, sender=signer.worker_id).message == RECORD
    at = signed.body.find(RECORD.SerializeToString()) + 3
    forged = envelope_pb2.SignedEnvelope(body=_flip_bit(signed.body, at), signature=signed.signature)
    with pytest.raises(WireRejected, match="bad signature"):
        gate.open(forged.SerializeToString(), swarm_pb2.RoundRecord, sender=signer.worker_id)
    flipped = envelope_pb2.SignedEnvelope(body=signed.body, signature=_flip_bit(signed.signature, 5))
    with pytest.raises(WireRejected, match="bad signature"):
        gate.open(flipped.SerializeToString(), swarm_pb2.RoundRecord, sender=signer.worker_id)


def test_a_record_signed_for_another_topic_is_refused_as_replayed(signer, gate):
    blob = signer.seal(RECORD, topic="r:round:s0:7", round=7)
    with pytest.raises(WireRejected, match="addressed to 'r:round:s0:7', not 'r:round:s0:9' \\(replayed or misdirected"):
        gate.open(blob, swarm_pb2.RoundRecord, topic="r:round:s0:9")


@pytest.mark.parametrize("window", [9, range(8, 12)])
def test_a_round_outside_the_accepted_window_is_refused(signer, gate, window):
    blob = signer.seal(RECORD, topic="k", round=7)
    with pytest.raises(WireRejected, match="about round 7, outside the window"):
        gate.open(blob, swarm_pb2.RoundRecord, round=window)


def test_a_reply_answering_another_nonce_is_refused(signer, gate):
    blob = signer.seal(swarm_pb2.StateHeader(), in_reply_to=b"\x01" * 16)
    with pytest.raises(WireRejected, match="answers another request \\(replayed\\)"):
        gate.open(blob, swarm_pb2.StateHeader, in_reply_to=b"\x02" * 16)


def test_a_request_opened_twice_is_refused_as_replayed(signer, gate):
    blob = signer.seal(REQUEST, topic="me")
    gate.open(blob, swarm_pb2.StateRequest, topic="me", fresh=True)
    with pytest.raises(WireRejected, match="replayed \\(nonce seen before\\)"):
        gate.open(blob, swarm_pb2.StateRequest, topic="me", fresh=True)


def test_a_record_may_be_read_any_number_of_times(signer, gate):
    blob = signer.seal(RECORD, topic="k")
    for _ in range(3):
        gate.open(blob, swarm_pb2.RoundRecord, topic="k")  # fresh=False: DHT records are read again and again


@pytest.mark.parametrize("age_s", [REQUEST_MAX_AGE_S + 60, -(REQUEST_MAX_AGE_S + 60)], ids=["old", "from_the_future"])
def test_a_request_sent_outside_the_age_limit_is_refused(signer, gate, age_s):
    blob = _resign(signer, signer.seal(REQUEST, topic="me"), sent_at=time.time() - age_s)
    with pytest.raises(WireRejected, match="outside \\+-300s \\(replayed, or a clock far off\\)"):
        gate.open(blob, swarm_pb2.StateRequest, fresh=True)


def test_a_request_with_a_send_time_that_is_not_a_number_is_refused(signer, gate):
    blob = _resign(signer, signer.seal(REQUEST, topic="me"), sent_at=float("nan"))
    with pytest.raises(WireRejected):
        gate.open(blob, swarm_pb2.StateRequest, fresh=True)


def test_a_request_turns_stale_as_the_clock_moves_on(signer, gate, monkeypatch):
    blob = signer.seal(REQUEST, topic="me")
    later = time.time() + REQUEST_MAX_AGE_S + 1
    monkeypatch.setattr(time, "time", lambda: later)
    with pytest.raises(WireRejected, match="sent \\+30[01]s ago: outside"):
        gate.open(blob, swarm_pb2.StateRequest, fresh=True)


def test_an_oversized_message_is_refused_before_parsing(gate):
    blob = b"\xff" * 10_000_000  # garbage: parsing it would say "malformed"
    with pytest.raises(WireRejected, match="message of 10000000 bytes > limit 5120: refused before parsing"):
        gate.open(blob, swarm_pb2.RoundRecord, max_bytes=1024)


def test_a_payload_over_the_payload_limit_is_refused(signer, gate):
    blob = signer.seal(swarm_pb2.ConfigRecord(shared_json="x" * 3000), topic="k")
    with pytest.raises(WireRejected, match="ConfigRecord: 30.. bytes > limit 1024"):
        gate.open(blob, swarm_pb2.ConfigRecord, max_bytes=1024)  # the envelope fits the slack, its payload does not


@pytest.mark.parametrize(
    "blob", [b"\xff\xff\xff\xff", b"\x0a\x05abc", envelope_pb2.SignedEnvelope(body=b"\x0a\x80").SerializeToString()]
)
def test_malformed_bytes_are_refused(gate, blob):
    with pytest.raises(WireRejected, match="malformed envelope"):
        gate.open(blob, swarm_pb2.RoundRecord)


@pytest.mark.parametrize("blob", ["a string", None, bytearray(b"\x0a\x00")])
def test_anything_but_bytes_is_refused(gate, blob):
    with pytest.raises(WireRejected, match="expected a signed envelope \\(bytes\\)"):
        gate.open(blob, swarm_pb2.RoundRecord)


def test_an_envelope_of_another_protocol_version_is_refused_and_names_that_version(signer, gate, monkeypatch):
    monkeypatch.setenv("DILOCOX_FAULTS", "speak_other_protocol")
    blob = signer.seal(RECORD, topic="k")
    monkeypatch.delenv("DILOCOX_FAULTS")
    reason = f"protocol version {PROTOCOL_VERSION + 1} .* speaks version {PROTOCOL_VERSION}"
    with pytest.raises(ForeignProtocol, match=reason) as refused:
        gate.open(blob, swarm_pb2.RoundRecord)
    assert refused.value.version == PROTOCOL_VERSION + 1 and isinstance(refused.value, WireRejected)
    assert gate.check(blob, any_protocol=True).protocol == PROTOCOL_VERSION + 1  # what the DHT's validator lets through


def test_an_envelope_of_another_run_is_refused(signer):
    with pytest.raises(WireRejected, match="envelope of run 'r', not 'other-run'"):
        Gate(Policy(run_id="other-run")).open(signer.seal(RECORD), swarm_pb2.RoundRecord)


def test_a_certificate_for_another_run_is_refused(keys, gate):
    signer = _signer(*keys, run_id="other-run")
    blob = _resign(signer, signer.seal(RECORD), run_id=RUN)  # the envelope claims this run, its certificate does not
    with pytest.raises(WireRejected, match="certificate .* is not signed by the peer key it names"):
        gate.open(blob, swarm_pb2.RoundRecord)


def test_a_payload_of_another_type_is_refused(signer, gate):
    with pytest.raises(WireRejected, match="expected a StateRequest, got a 'dilocox.v1.RoundRecord'"):
        gate.open(signer.seal(RECORD), swarm_pb2.StateRequest)


def test_a_banned_sender_is_refused(signer, gate):
    blob = signer.seal(RECORD)
    gate.ban([signer.worker_id])
    with pytest.raises(WireRejected, match="is banned for this run"):
        gate.open(blob, swarm_pb2.RoundRecord)


def test_a_ban_reaches_every_worker_the_banned_workers_peer_key_certifies(keys, gate, tmp_path):
    # bans counted worker ids: after one allowlisted key's 5 workers were banned, a sixth was taken (issue 38, point 2)
    worker_key, peer_key = keys
    banned, sixth = _signer(worker_key, peer_key), _signer(identity.worker_identity(tmp_path / "w6.key"), peer_key)
    stranger = _signer(identity.worker_identity(tmp_path / "s.key"), identity.write_identity(tmp_path / "s.pem"))
    gate.ban([banned.worker_id], [bytes(banned.certificate.peer_key)])

    with pytest.raises(WireRejected, match="banned for this run \\(the peer key that certifies it is\\)"):
        gate.open(sixth.seal(RECORD), swarm_pb2.RoundRecord)
    assert gate.open(stranger.seal(RECORD), swarm_pb2.RoundRecord).sender == stranger.worker_id


def test_a_worker_certificate_not_signed_by_the_peer_key_it_names_is_refused(keys, gate, tmp_path):
    worker_key, peer_key = keys
    cert = identity.certify_worker(peer_key, identity.peer_id_of(worker_key), run_id=RUN, stage=0, peer_name="t")
    cert.peer_name = "someone else"  # changed after signing
    with pytest.raises(WireRejected, match="certificate of .* is not signed by the peer key it names"):
        gate.open(Signer(worker_key, cert).seal(RECORD), swarm_pb2.RoundRecord)
    impostor = identity.write_identity(tmp_path / "impostor.pem")
    forged = identity.certify_worker(impostor, identity.peer_id_of(worker_key), run_id=RUN, stage=0, peer_name="t")
    forged.peer_key = identity.public_raw(peer_key)  # claims another peer's key
    with pytest.raises(WireRejected, match="not signed by the peer key it names"):
        gate.open(Signer(worker_key, forged).seal(RECORD), swarm_pb2.RoundRecord)


def test_a_signer_refuses_a_certificate_for_another_worker_key(keys, tmp_path):
    worker_key, peer_key = keys
    other = identity.peer_id_of(identity.worker_identity(tmp_path / "other.key"))
    cert = identity.certify_worker(peer_key, other, run_id=RUN, stage=0, peer_name="t")
    with pytest.raises(ValueError, match="names another worker key"):
        Signer(worker_key, cert)


# ----- closed runs -----------------------------------------------------------------------------
@pytest.fixture
def run_key(tmp_path):
    return identity.write_identity(tmp_path / "run.pem")


def _closed(run_key, allowlist=()) -> Gate:
    return Gate(Policy(run_id=RUN, closed=True, allowlist=frozenset(allowlist), run_key=identity.public_raw(run_key)))


def test_a_closed_run_admits_an_allowlisted_key(keys, run_key):
    blob = _signer(*keys).seal(RECORD)
    assert _closed(run_key, [identity.public_raw(keys[1])]).open(blob, swarm_pb2.RoundRecord).message == RECORD


def test_a_closed_run_refuses_an_unknown_key_with_the_reason(keys, run_key, tmp_path):
    stranger = identity.public_raw(identity.write_identity(tmp_path / "stranger.pem"))
    blob = _signer(*keys, peer_name="mallory").seal(RECORD)
    with pytest.raises(WireRejected, match="peer 'mallory'\\) not admitted: peer key [0-9a-f]{16}\\.\\.\\. is not on this "
                                           "closed run's allowlist and holds no certificate"):
        _closed(run_key, [stranger]).open(blob, swarm_pb2.RoundRecord)


def test_a_closed_run_admits_a_key_holding_a_certificate_signed_by_the_run_key(keys, run_key):
    admission = identity.certify_peer(run_key, identity.public_raw(keys[1]), run_id=RUN, note="for t")
    blob = _signer(*keys, admission=admission).seal(RECORD)
    opened = _closed(run_key).open(blob, swarm_pb2.RoundRecord)
    assert opened.message == RECORD and opened.envelope.admission.note == "for t"


@pytest.mark.parametrize("wrong", ["signed_by_another_key", "for_another_run", "for_another_peer_key"])
def test_a_closed_run_refuses_a_certificate_the_run_key_did_not_sign_for_this_peer(keys, run_key, tmp_path, wrong):
    peer_raw = identity.public_raw(keys[1])
    if wrong == "signed_by_another_key":
        admission = identity.certify_peer(identity.write_identity(tmp_path / "x.pem"), peer_raw, run_id=RUN)
    elif wrong == "for_another_run":
        admission = identity.certify_peer(run_key, peer_raw, run_id="other-run")
    else:
        another_peer = identity.public_raw(identity.write_identity(tmp_path / "y.pem"))
        admission = identity.certify_peer(run_key, another_peer, run_id=RUN)
    blob = _signer(*keys, admission=admission).seal(RECORD)
    with pytest.raises(WireRejected, match="not admitted: .* holds a certificate this run's key did not sign for it"):
        _closed(run_key).open(blob, swarm_pb2.RoundRecord)


def test_an_open_run_admits_any_validly_signed_key(keys):
    assert Gate(Policy(run_id=RUN)).open(_signer(*keys).seal(RECORD), swarm_pb2.RoundRecord).message == RECORD


# ----- identities ------------------------------------------------------------------------------
def test_a_peer_id_names_its_ed25519_key_and_back(keys):
    worker_key, _ = keys
    peer_id = identity.peer_id_of(worker_key)
    assert peer_id.startswith("12D3KooW")
    assert identity.public_raw(identity.public_key_of(peer_id)) == identity.public_raw(worker_key)
    assert identity.peer_id_of(identity.public_key_of(peer_id)) == peer_id


@pytest.mark.parametrize(
    ("peer_id", "reason"),
    [
        ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "not an Ed25519 identity peer id"),  # RSA: a hashed id
        ("0OIl", "not a base58 peer id"),
        ("", "not an Ed25519 identity peer id"),
    ],
)
def test_public_key_of_refuses_peer_ids_that_are_not_ed25519_identities(peer_id, reason):
    with pytest.raises(ValueError, match=reason):
        identity.public_key_of(peer_id)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_peer_key_others_can_read_is_refused_with_the_fix(tmp_path, mode):
    path = tmp_path / "peer.pem"
    identity.write_identity(path)
    path.chmod(mode)
    with pytest.raises(IdentityError, match=f"readable by others \\(mode {mode:04o}\\).*chmod 600"):
        identity.load_identity(path)


def test_a_peer_key_is_written_0600_and_loads_back(tmp_path):
    path = tmp_path / "peer.pem"
    key = identity.write_identity(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert identity.public_raw(identity.load_identity(path)) == identity.public_raw(key)


def test_writing_a_peer_key_never_overwrites_one(tmp_path):
    path = tmp_path / "peer.pem"
    identity.write_identity(path)
    before = path.read_bytes()
    with pytest.raises(IdentityError, match="already exists: refusing to overwrite"):
        identity.write_identity(path)
    assert path.read_bytes() == before


def test_a_missing_or_non_pem_peer_key_is_refused(tmp_path):
    with pytest.raises(IdentityError, match="does not exist"):
        identity.load_identity(tmp_path / "nowhere.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_bytes(b"not a key")
    garbage.chmod(0o600)
    with pytest.raises(IdentityError, match="not an unencrypted PEM private key"):
        identity.load_identity(garbage)


def test_a_worker_key_is_reused_on_a_second_call(tmp_path):
    path = tmp_path / "stage0.ed25519"
    first = identity.worker_identity(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert identity.peer_id_of(identity.worker_identity(path)) == identity.peer_id_of(first)


def test_an_unreadable_worker_key_is_refused(tmp_path):
    path = tmp_path / "stage0.ed25519"
    path.write_bytes(b"\xff\xff\xff")
    with pytest.raises(IdentityError, match="unreadable"):
        identity.worker_identity(path)


# ----- the DHT's record validator --------------------------------------------------------------
CONFIG_HASH = "0" * 64


@pytest.fixture
def validator() -> EnvelopeValidator:
    return EnvelopeValidator(Gate(Policy(run_id=RUN)), run_keys(RUN, CONFIG_HASH))


def _record(key: str, subkey: object, value: object) -> DHTRecord:
    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=MSGPackSerializer.dumps(subkey),
        value=MSGPackSerializer.dumps(value),
        expiration_time=get_dht_time() + 30,
    )


def test_the_validator_takes_a_record_signed_for_its_key_by_its_subkeys_worker(validator, signer):
    key = f"{RUN}:members:s0"
    assert validator.validate(_record(key, signer.worker_id, signer.seal(RECORD, topic=key))) is True


def test_the_validator_refuses_a_record_stored_under_a_key_it_was_not_signed_for(validator, signer, caplog):
    blob = signer.seal(RECORD, topic=f"{RUN}:round:s0:7", round=7)
    assert validator.validate(_record(f"{RUN}:round:s0:9", signer.worker_id, blob)) is False
    assert "signed for 'r:round:s0:7' stored under another key (replayed)" in caplog.text


def test_the_validator_refuses_a_record_whose_subkey_is_not_its_signer(validator, signer, tmp_path):
    other = identity.peer_id_of(identity.worker_identity(tmp_path / "other.key"))
    key = f"{RUN}:members:s0"
    assert validator.validate(_record(key, other, signer.seal(RECORD, topic=key))) is False


def test_the_validator_leaves_hivemind_records_with_bytes_subkeys_alone(validator):
    assert validator.validate(_record("some.hivemind.matchmaking.key", b"\x01\x02", b"anything")) is True


@pytest.mark.parametrize("key", [f"{RUN}:members:s0", f"{RUN}:members:s63", f"{RUN}:config:{CONFIG_HASH}"])
def test_the_validator_refuses_a_plain_value_under_a_run_key(validator, key):
    plain = DHTRecord(
        key=DHTID.generate(source=key).to_bytes(), subkey=b"", value=MSGPackSerializer.dumps(b"x"),
        expiration_time=get_dht_time() + 30,
    )  # fmt: skip
    assert validator.validate(plain) is False
    assert validator.validate(_record(key, None, b"x")) is False  # subkey = serializer.dumps(None)
    assert validator.refusals["a value with no signed subkey under one of the run's keys"] == 1
    assert validator.refusals["a plain value"] == 1


@pytest.mark.parametrize("key", [f"{RUN}:round:s0:5", f"{RUN}:average:s0:5", "any.other.key"])
def test_the_validator_refuses_a_plain_value_under_every_key(validator, key):
    # a plain value with a far expiration replaced every record under a round or average key (issue 38, point 3)
    plain = _record(key, None, b"x")  # subkey = serializer.dumps(None): hivemind's regular value
    plain = DHTRecord(plain.key, plain.subkey, plain.value, expiration_time=get_dht_time() + 31 * 365 * 86400)
    assert validator.validate(plain) is False
    assert validator.refusals["a plain value"] == 1


def _resigned(signer: Signer, blob: bytes, **fields: object) -> bytes:
    """`blob` (a sealed record) with envelope `fields` changed, signed again by its worker: as it would have
    sealed it then."""
    envelope = envelope_pb2.Envelope.FromString(envelope_pb2.SignedEnvelope.FromString(blob).body)
    for name, value in fields.items():
        setattr(envelope, name, value)
    body = envelope.SerializeToString()
    return envelope_pb2.SignedEnvelope(body=body, signature=signer.worker_key.sign(body)).SerializeToString()


@pytest.mark.parametrize(("signed_ago", "expires_in", "taken"), [
    (0.0, 15.0, True),  # as its worker stores it: a member record lives MEMBER_TTL_S
    (0.0, 365 * 86400.0, False),  # given a year: it would outlast (and block) every newer record of its worker
    (100.0, 15.0, False),  # an old record stored again as if fresh: replayed
    (100.0, -85.0, True),  # an old record as it was stored (hivemind hands records on with their expiration)
])  # fmt: skip
def test_the_validator_refuses_a_record_expiring_later_than_its_signature_allows(
    validator, signer, signed_ago, expires_in, taken
):
    key, now = f"{RUN}:members:s0", get_dht_time()
    member = swarm_pb2.MemberRecord(run_id=RUN, stage=0, training=True, joined_at=now - 1000)
    blob = _resigned(signer, signer.seal(member, topic=key), sent_at=now - signed_ago)
    record = _record(key, signer.worker_id, blob)
    record = DHTRecord(record.key, record.subkey, record.value, expiration_time=now + expires_in)
    assert validator.validate(record) is taken
    assert validator.refusals["a record expiring later than its signature allows"] == (0 if taken else 1)


def test_the_validator_refuses_unreadable_values_without_raising(validator, signer):
    key = f"{RUN}:members:s0"
    record = DHTRecord(
        key=DHTID.generate(source=key).to_bytes(), subkey=MSGPackSerializer.dumps(signer.worker_id), value=b"\xc1",
        expiration_time=get_dht_time() + 30,
    )  # fmt: skip
    assert validator.validate(record) is False
    assert validator.validate(_record(key, signer.worker_id, "a string, not bytes")) is False
