"""Fuzzing every decoder of bytes from another peer: nothing but the documented refusal comes out.

A peer's bytes reach this process through a handful of decoders; each is fed random bytes,
protobuf-shaped bytes and mutations (flipped bits, truncations, insertions, deletions) of valid
messages, and may only accept or refuse them the documented way:

    wire.decode                   WireRejected (every message of swarm, envelope and compression.proto)
    Gate.open / Gate.check        WireRejected; a mutated envelope is never accepted with other bytes
                                  than were signed
    EnvelopeValidator.validate    a bool, never an exception
    StageCodec.receive            MessageRejected (fp16, int8, topk, lowrank); what it accepts decodes
    payload.unframe               ValueError (its docstring)
    transfer.read_stream          TimeoutError, Oversized, WireRejected (a part that is not uncompressed
                                  float32, or parts that do not make a tensor)

Cases are derandomized (the same ones on every run) and Ed25519 keys come from fixed seeds. Hypothesis draws
the inputs whose structure is searched (protobuf-shaped bytes, envelopes of any field values, reframed messages);
mutations of a valid message are drawn from a seed (tests/helpers/seeded.py), at a fraction of a hypothesis
example's cost. The passing tests run 17,450 cases: 27 message classes x 150 for wire.decode, 4,400 for envelopes,
1,200 for the DHT validator, 4,000 for StageCodec.receive, 1,000 for unframe, 900 for read_stream and 1,900 for
the compressed butterfly's parts. About 35 s in one process on a 2-core CI machine.

    pytest tests/unit/test_fuzz_decoders.py -q --durations=0
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError, Message
from hivemind.compression import serialize_torch_tensor
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import dilocox_p2p.compression.payload as payload
from dilocox_p2p.compression.butterfly import assemble, cut_all, part_spans, reduce
from dilocox_p2p.compression.codec import MessageRejected, StageCodec
from dilocox_p2p.compression.payload import frame, unframe
from dilocox_p2p.config import CompressionConfig
from dilocox_p2p.envelope import Gate, Policy
from dilocox_p2p.errors import WireRejected
from dilocox_p2p.identity import certify_peer, certify_worker, peer_id_of, public_raw
from dilocox_p2p.proto_gen import compression_pb2, envelope_pb2, swarm_pb2
from dilocox_p2p.swarm.transfer import Oversized, read_stream
from dilocox_p2p.swarm.dht import EnvelopeValidator, run_keys
from dilocox_p2p.wire import PROTOCOL_VERSION, decode
from tests.helpers import seeded
from tests.helpers.seeded import byte_edits, check_each, mutate

pytestmark = pytest.mark.unit

T = TypeVar("T")


def fuzz(n: int, **kwargs):
    """Deterministic hypothesis settings: `n` examples, the same ones on every run."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow], **kwargs)  # fmt: skip


# ----- strategies ------------------------------------------------------------------------------
def _seeded(draw: Callable[[random.Random], T]) -> st.SearchStrategy[T]:
    """`draw`'s values as a hypothesis strategy: it draws a seed, and `draw` the rest (tests/helpers/seeded.py),
    which costs a fraction of drawing their structure through hypothesis."""
    return st.integers(0, 2**64 - 1).map(lambda seed: draw(random.Random(seed)))


protobuf_like = _seeded(seeded.protobuf_like)
"""Bytes shaped like protobuf messages (nested ones too), with the odd lie in them."""
peer_bytes = _seeded(seeded.peer_bytes)
edits = _seeded(byte_edits)
"""Mutations of a valid message inside a searched structure, for `mutate` (the tests whose input is only a
mutation draw `byte_edits` directly); a position is a share of the length, so it lands anywhere in it."""


# ----- wire.decode -----------------------------------------------------------------------------
MESSAGE_CLASSES = [
    getattr(module, name)
    for module in (swarm_pb2, envelope_pb2, compression_pb2)
    for name in module.DESCRIPTOR.message_types_by_name
]  # 24 classes


@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda c: c.DESCRIPTOR.name)
def test_wire_decode_accepts_or_refuses_any_bytes_with_wire_rejected(cls):
    draw = lambda rng: (seeded.peer_bytes(rng), rng.choice([64 * 1024, 256, 16]))  # noqa: E731
    check_each(150, draw, lambda case: _decoded(cls, *case), seed=100 + MESSAGE_CLASSES.index(cls))


def _decoded(cls: type[Message], blob: bytes, max_bytes: int) -> None:
    try:
        message = decode(cls, blob, max_bytes=max_bytes)
    except WireRejected:
        return
    assert isinstance(message, cls) and len(blob) <= max_bytes
    assert all(math.isfinite(v) for _, v in message.ListFields() if isinstance(v, float))


# ----- signed envelopes ------------------------------------------------------------------------
RUN = "fuzz-run"
SENT_AT = 1_700_000_000.0  # fixed: envelopes here are bytes-identical on every run (requests: stale)


def _key(name: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(name.encode()).digest())


RUN_KEY = _key("run")
WORKER_A, PEER_A = _key("worker a"), _key("peer a")  # admitted by a RunCertificate
WORKER_B, PEER_B = _key("worker b"), _key("peer b")  # admitted by the allowlist
ID_A, ID_B = peer_id_of(WORKER_A), peer_id_of(WORKER_B)
CERT_A = certify_worker(PEER_A, ID_A, run_id=RUN, stage=0, peer_name="a")
CERT_B = certify_worker(PEER_B, ID_B, run_id=RUN, stage=1, peer_name="b")
ADMISSION_A = certify_peer(RUN_KEY, public_raw(PEER_A), run_id=RUN, note="a")
POLICY = Policy(run_id=RUN, closed=True, allowlist=frozenset({public_raw(PEER_B)}), run_key=public_raw(RUN_KEY))
MEMBERS_KEY, ROUND_KEY, CONFIG_KEY = f"{RUN}:members:s0", f"{RUN}:round:s0:7", f"{RUN}:config:{'0' * 64}"
AVERAGE_KEY = f"{RUN}:average:s0:6"
NONCE = bytes(range(16))


@dataclass(frozen=True)
class Sealed:
    cls: type[Message]
    message: Message
    key: Ed25519PrivateKey
    body: bytes
    blob: bytes
    topic: str
    round: int
    in_reply_to: bytes


def _seal(message: Message, *, worker: str = "a", topic: str = "", round: int = 0, in_reply_to: bytes = b"") -> Sealed:
    key, cert = (WORKER_A, CERT_A) if worker == "a" else (WORKER_B, CERT_B)
    envelope = envelope_pb2.Envelope(
        protocol=PROTOCOL_VERSION, run_id=RUN, type=message.DESCRIPTOR.full_name, topic=topic, round=round,
        nonce=NONCE, in_reply_to=in_reply_to, sent_at=SENT_AT, payload=message.SerializeToString(), sender=cert,
    )  # fmt: skip
    if worker == "a":
        envelope.admission.CopyFrom(ADMISSION_A)
    body = envelope.SerializeToString()
    blob = envelope_pb2.SignedEnvelope(body=body, signature=key.sign(body)).SerializeToString()
    return Sealed(type(message), message, key, body, blob, topic, round, in_reply_to)


SEALED = [
    _seal(swarm_pb2.RoundRecord(boundary=7, state_hash="ab" * 32, group_size=3, coverage=0.5), topic=ROUND_KEY, round=7),
    _seal(swarm_pb2.MemberRecord(run_id=RUN, config_hash="cd" * 32, boundary=7, joined_at=1.5, peer_name="b",
                                 training=True), worker="b", topic=MEMBERS_KEY),  # fmt: skip
    _seal(swarm_pb2.ConfigRecord(config_hash="0" * 64, shared_json='{"a": 1}'), topic=CONFIG_KEY),
    _seal(swarm_pb2.AverageRecord(round=6, group_id=b"g", average_hash="ef" * 32, kind="partial",
                                  missing=[swarm_pb2.Span(start=2, end=9)]), worker="b", topic=AVERAGE_KEY, round=6),
    _seal(swarm_pb2.StateRequest(run_id=RUN, boundary=7, wait_s=2.0), topic=ID_B, round=7),
    _seal(swarm_pb2.StateHeader(boundary=7, n_tensors=3, has_pending=True, sha256=b"\x01" * 32,
                                pending=swarm_pb2.AverageInfo(round=6, group=[ID_A, ID_B], missing=[swarm_pb2.Span(end=4)])),
          worker="b", topic=ID_A, round=7, in_reply_to=b"\x09" * 16),  # fmt: skip
    _seal(envelope_pb2.MessageDigest(group_id=b"g", phase=1, size=100, sha256=b"\x02" * 32), topic="g", round=3),
]
sealed_index = st.integers(0, len(SEALED) - 1)


def _open(gate: Gate, sealed: Sealed, blob: object, **kwargs):
    return gate.open(blob, sealed.cls, topic=sealed.topic, round=sealed.round,
                     in_reply_to=sealed.in_reply_to or None, **kwargs)  # fmt: skip


def test_the_valid_envelopes_fuzzed_here_are_accepted_as_sealed():
    gate = Gate(POLICY)
    for sealed in SEALED:
        opened = _open(gate, sealed, sealed.blob, sender=peer_id_of(sealed.key))
        assert opened.message == sealed.message


def test_gate_open_refuses_random_bytes_with_wire_rejected():
    def check(case: tuple[bytes, type[Message], bool]) -> None:
        blob, cls, closed = case
        gate = Gate(POLICY if closed else Policy(run_id=RUN))
        with pytest.raises(WireRejected):
            gate.open(blob, cls, fresh=True)  # accepting random bytes would be forging an Ed25519 signature

    classes = [s.cls for s in SEALED]
    check_each(600, lambda rng: (seeded.peer_bytes(rng), rng.choice(classes), rng.random() < 0.5), check, seed=11)


def test_gate_check_refuses_random_bytes_with_wire_rejected():
    def check(case: tuple[bytes, bool]) -> None:
        with pytest.raises(WireRejected):
            Gate(POLICY).check(case[0], any_protocol=case[1])

    check_each(400, lambda rng: (seeded.peer_bytes(rng), rng.random() < 0.5), check, seed=12)


def _sealed_edits(rng) -> tuple[int, list[tuple], bool]:
    return rng.randrange(len(SEALED)), byte_edits(rng), rng.random() < 0.5


def test_a_mutated_envelope_is_refused_or_carries_exactly_the_signed_bytes():
    check_each(1200, _sealed_edits, lambda case: _mutated_envelope(*case), seed=1)


def _mutated_envelope(index: int, ops: list[tuple], named: bool) -> None:
    sealed = SEALED[index]
    blob = mutate(sealed.blob, ops)
    try:
        opened = _open(Gate(POLICY), sealed, blob, sender=peer_id_of(sealed.key) if named else None)
    except WireRejected:
        return
    # accepted: only the unsigned framing changed (say, an unknown field added around the body)
    assert envelope_pb2.SignedEnvelope.FromString(blob).body == sealed.body
    assert opened.envelope.payload == sealed.message.SerializeToString() and opened.message == sealed.message
    assert opened.sender == peer_id_of(sealed.key)


def test_a_signed_body_changed_in_any_way_is_refused():
    check_each(800, _sealed_edits, lambda case: _changed_body(*case[:2]), seed=2)


def _changed_body(index: int, ops: list[tuple]) -> None:
    sealed = SEALED[index]
    body = mutate(sealed.body, ops)
    signature = envelope_pb2.SignedEnvelope.FromString(sealed.blob).signature
    blob = envelope_pb2.SignedEnvelope(body=body, signature=signature).SerializeToString()
    if body == sealed.body:
        assert _open(Gate(POLICY), sealed, blob).message == sealed.message
    else:
        with pytest.raises(WireRejected):
            _open(Gate(POLICY), sealed, blob)


GATE_FOR_SIGNED_GARBAGE = Gate(POLICY)  # one gate: it remembers nonces across examples, as a worker's does


def test_garbage_signed_by_a_valid_worker_key_is_refused_with_wire_rejected():
    """An admitted worker's key signs whatever its owner likes: the checks after the signature hold too."""
    check_each(800, _sealed_edits, lambda case: _signed_garbage(*case), seed=3)


def _signed_garbage(index: int, ops: list[tuple], fresh: bool) -> None:
    sealed = SEALED[index]
    body = mutate(sealed.body, ops)
    blob = envelope_pb2.SignedEnvelope(body=body, signature=sealed.key.sign(body)).SerializeToString()
    try:
        opened = _open(GATE_FOR_SIGNED_GARBAGE, sealed, blob, fresh=fresh)
    except WireRejected:
        return
    assert opened.sender == peer_id_of(sealed.key)
    assert opened.message == decode(sealed.cls, opened.envelope.payload)


_tampered = certify_worker(PEER_A, ID_A, run_id=RUN, stage=0, peer_name="a")
_tampered.stage = 5  # after signing
_texts = st.one_of(st.text(max_size=30), st.sampled_from([RUN, "other", ID_A, ID_B, MEMBERS_KEY]))


def mostly(valid: object, other: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` 4 times in 5, else anything `other` gives: examples get past one check and meet the next."""
    return st.integers(0, 4).flatmap(lambda i: st.just(valid) if i else other)


@st.composite
def envelopes(draw) -> tuple[bytes, type[Message]]:
    """Envelopes of any field values, each mostly valid (sent within +-400 s of now, or at any double),
    signed mostly by the worker key their certificate names."""
    sealed = draw(st.sampled_from(SEALED))
    cls, (key, cert) = sealed.cls, draw(mostly((WORKER_A, CERT_A), st.sampled_from([(WORKER_B, CERT_B), (RUN_KEY, CERT_A),
                                                                                    (WORKER_A, _tampered)])))  # fmt: skip
    envelope = envelope_pb2.Envelope(
        protocol=draw(mostly(PROTOCOL_VERSION, st.integers(0, 2**32 - 1))),
        run_id=draw(mostly(RUN, _texts)),
        type=draw(mostly(cls.DESCRIPTOR.full_name, st.text(max_size=30))),
        topic=draw(_texts),
        round=draw(st.integers(-(2**63), 2**63 - 1)),
        nonce=draw(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20))),
        in_reply_to=draw(st.binary(max_size=20)),
        sent_at=draw(mostly(None, st.floats())) or time.time() + draw(st.floats(-400, 400)),
        payload=draw(mostly(sealed.message.SerializeToString(), peer_bytes)),
        sender=cert,
    )
    admission = draw(st.sampled_from([None, ADMISSION_A, certify_peer(RUN_KEY, b"\x00" * 32, run_id=RUN)]))
    if admission is not None:
        envelope.admission.CopyFrom(admission)
    body = envelope.SerializeToString()
    return envelope_pb2.SignedEnvelope(body=body, signature=key.sign(body)).SerializeToString(), cls


@fuzz(600)
@given(sealed=envelopes(), fresh=st.booleans(), closed=st.booleans())
def test_signed_envelopes_of_any_field_values_are_accepted_or_refused_with_wire_rejected(sealed, fresh, closed):
    blob, cls = sealed
    try:
        opened = Gate(POLICY if closed else Policy(run_id=RUN)).open(blob, cls, fresh=fresh)
    except WireRejected:
        return
    assert opened.sender in (ID_A, ID_B) and opened.envelope.run_id == RUN


# ----- the DHT's record validator --------------------------------------------------------------
VALIDATOR = EnvelopeValidator(Gate(POLICY), run_keys(RUN, "0" * 64))
_dht_keys = [MEMBERS_KEY, ROUND_KEY, CONFIG_KEY, f"{RUN}:members:s63", "hivemind.key"]
GUARDED = {MEMBERS_KEY, CONFIG_KEY, f"{RUN}:members:s63"}  # among _dht_keys, those run_keys names
_msgpack_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.binary(max_size=40), st.text(max_size=40),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3), st.sampled_from([s.blob for s in SEALED]),
)  # fmt: skip


@fuzz(600)
@given(key=st.binary(max_size=30), subkey=st.binary(max_size=60), value=st.binary(max_size=300), guarded=st.booleans())
def test_the_validator_returns_a_bool_for_any_record_bytes(key, subkey, value, guarded):
    if guarded:
        key = DHTID.generate(source=MEMBERS_KEY).to_bytes()
    verdict = VALIDATOR.validate(DHTRecord(key=key, subkey=subkey, value=value, expiration_time=0.0))
    assert isinstance(verdict, bool)


@fuzz(600)
@given(key=st.sampled_from(_dht_keys), subkey=st.one_of(st.sampled_from([ID_A, ID_B]), _msgpack_values),
       value=st.one_of(st.tuples(sealed_index, edits).map(lambda p: mutate(SEALED[p[0]].blob, p[1])),
                       _msgpack_values))  # fmt: skip
def test_the_validator_takes_only_records_signed_for_their_key_by_their_subkey(key, subkey, value):
    record = DHTRecord(
        key=DHTID.generate(source=key).to_bytes(), subkey=MSGPackSerializer.dumps(subkey),
        value=MSGPackSerializer.dumps(value), expiration_time=0.0,
    )  # fmt: skip
    verdict = VALIDATOR.validate(record)
    assert isinstance(verdict, bool)
    if subkey is None:  # a plain value (no subkey) would replace every record under its key: refused everywhere
        assert not verdict
        return
    if not isinstance(subkey, str):  # not one of ours: hivemind's own, taken unless under a run key
        assert verdict == (key not in GUARDED)
        return
    if any(value == s.blob and s.topic == key and peer_id_of(s.key) == subkey for s in SEALED):
        assert verdict  # a record as its worker stored it
    if verdict:  # one of ours, taken: exactly the bytes a worker signed for this key, its subkey the signer
        body = envelope_pb2.SignedEnvelope.FromString(value).body
        (sealed,) = [s for s in SEALED if s.body == body]
        assert sealed.topic == key and peer_id_of(sealed.key) == subkey


# ----- compressed messages (StageCodec.receive, payload.unframe) -------------------------------
SHAPES = [torch.Size((24, 16)), torch.Size((16,)), torch.Size((16, 40)), torch.Size((3, 5))]
NAMES = ["a.weight", "a.bias", "b.weight", "c.weight"]
ROUND = 3
KINDS = ["fp16", "int8", "fp4", "topk", "lowrank"]


def _codec(kind: str) -> tuple[StageCodec, dict[int, bytes]]:
    cfg = CompressionConfig(kind=kind, rank=2, rank_max=4, energy_target=0.0, topk_chunk=16, topk_density=0.25, block=16)
    codec = StageCodec(cfg, NAMES, SHAPES, run_id="fuzz")
    generator = torch.Generator().manual_seed(0)
    round_codec = codec.begin(ROUND, [torch.randn(s, generator=generator) * 1e-3 for s in SHAPES])
    messages = {1: round_codec.message(1)}
    if codec.phases == 2:
        messages[2] = round_codec.message(2, [messages[1]])
    return codec, messages


CODECS = {kind: _codec(kind) for kind in KINDS}


@contextlib.contextmanager
def small_slices():
    """Readers decode a few hundred values at a time (several slices a tensor and a part), as they would a stage of
    millions (payload.SLICE)."""
    saved, payload.SLICE = payload.SLICE, 256
    try:
        yield
    finally:
        payload.SLICE = saved


def _receive(kind: str, blob: bytes, phase: int) -> None:
    """StageCodec.receive; what it accepts must decode whole and a slice at a time, to finite values."""
    codec, _ = CODECS[kind]
    with small_slices():
        try:
            received = codec.receive(blob, round=ROUND, phase=phase)
        except MessageRejected:
            return
        assert math.isfinite(received.norm())
        pieces = received.pieces()
    assert [p.shape for p in pieces] == received.layout.shapes
    assert all(bool(torch.isfinite(p).all()) for p in pieces)


def test_the_valid_messages_fuzzed_here_are_received():
    for kind, (codec, messages) in CODECS.items():
        for phase, blob in messages.items():
            codec.receive(blob, round=ROUND, phase=phase)


framed_garbage = st.builds(
    lambda head, rest: struct.pack("<I", len(head)) + head + rest, protobuf_like, st.binary(max_size=200)
)
"""A length prefix that fits, a protobuf-shaped header, then any bytes."""


@pytest.mark.parametrize("kind", KINDS)
@fuzz(250)
@given(blob=st.one_of(st.binary(max_size=400), framed_garbage), phase=st.integers(1, 2))
def test_stage_codec_receive_refuses_random_bytes_with_message_rejected(kind, blob, phase):
    _receive(kind, blob, phase)


@pytest.mark.parametrize("kind", KINDS)
def test_stage_codec_receive_takes_mutated_messages_or_refuses_them_with_message_rejected(kind):
    messages = CODECS[kind][1]

    def check(case: tuple[int, list[tuple]]) -> None:
        phase = min(case[0], max(messages))
        _receive(kind, mutate(messages[phase], case[1]), phase)

    check_each(350, lambda rng: (rng.randint(1, 2), byte_edits(rng)), check, seed=4 + KINDS.index(kind))


@st.composite
def reframed(draw, kind: str) -> tuple[bytes, int]:
    """A valid message with header fields changed and sections resized or replaced, framed again."""
    messages = CODECS[kind][1]
    phase = draw(st.sampled_from(sorted(messages)))
    header, sections = unframe(messages[phase])
    sections = [bytes(s) for s in sections]
    small = st.integers(-3, 70)
    edits_of_header = {
        "ranks": lambda: header.ranks.__setitem__(slice(None), draw(st.lists(small, max_size=3))),
        "shape": lambda: header.payload.shape.__setitem__(slice(None), draw(st.lists(st.integers(-1, 3000), max_size=2))),
        "quantized": lambda: header.payload.quantized.CopyFrom(
            compression_pb2.QuantizedTensor(bits=draw(st.sampled_from([0, 4, 8, 16])), block=draw(small))),
        "sparse": lambda: header.payload.sparse.CopyFrom(compression_pb2.SparseTensor(
            chunk=draw(small), k=draw(small), bits=draw(st.sampled_from([1, 2, 3, 4, 5])))),
        "fp16": lambda: header.payload.fp16.SetInParent(),
        "energies": lambda: header.energy_kept.__setitem__(slice(None), draw(st.lists(st.floats(), max_size=3))),
    }  # fmt: skip
    for name in draw(st.lists(st.sampled_from(sorted(edits_of_header)), max_size=2)):
        edits_of_header[name]()
    for i in draw(st.lists(st.integers(0, max(len(sections) - 1, 0)), max_size=2)) if sections else []:
        sections[i] = draw(st.one_of(st.binary(max_size=3 * len(sections[i]) + 4),
                                     st.just(sections[i]).map(lambda s: s[: len(s) // 2])))  # fmt: skip
    return frame(header, [[s] for s in sections]), phase


@pytest.mark.parametrize("kind", KINDS)
@fuzz(200)
@given(data=st.data())
def test_stage_codec_receive_refuses_inconsistent_headers_and_sections_with_message_rejected(kind, data):
    blob, phase = data.draw(reframed(kind))
    _receive(kind, blob, phase)


@fuzz(600)
@given(blob=st.one_of(st.binary(max_size=300), framed_garbage))
def test_unframe_refuses_unframed_bytes_with_value_or_decode_error_and_nothing_else(blob):
    try:
        message, sections = unframe(blob)
    except (ValueError, DecodeError):
        return
    assert isinstance(message, compression_pb2.CompressedMessage)
    (header_bytes,) = struct.unpack_from("<I", blob)
    assert [len(s) for s in sections] == list(message.payload.sections)
    assert 4 + header_bytes + sum(message.payload.sections) == len(blob)


@fuzz(400, phases=[Phase.explicit, Phase.generate])
@given(blob=framed_garbage)
def test_unframe_refuses_unframed_bytes_with_value_error_as_documented(blob):
    try:
        unframe(blob)
    except ValueError:
        pass


# ----- replies streamed to a download (transfer.read_stream) ----------------------------------
async def _chunks(chunks: list[swarm_pb2.Chunk]):
    for chunk in chunks:
        yield chunk


def _read(chunks: list[swarm_pb2.Chunk], *, max_bytes: int):
    return asyncio.run(read_stream(_chunks(chunks), first_within=5.0, each_within=5.0, total_within=10.0,
                                    max_bytes=max_bytes))  # fmt: skip


@fuzz(200)
@given(head=st.binary(max_size=200))
def test_read_stream_takes_any_header_bytes_as_the_header(head):
    reply = _read([swarm_pb2.Chunk(head=head)], max_bytes=1 << 20)
    assert reply.head == head and reply.tensors == [] and reply.sha256 == hashlib.sha256().digest()


@fuzz(300)
@given(head=st.binary(max_size=40), parts=st.lists(st.binary(min_size=1, max_size=200), min_size=1, max_size=4),
       max_bytes=st.integers(0, 60))  # fmt: skip
def test_read_stream_refuses_a_reply_over_its_limit_before_parsing_the_part_that_exceeds_it(head, parts, max_bytes):
    chunks = [swarm_pb2.Chunk(head=head)] + [swarm_pb2.Chunk(tensor_part=p) for p in parts]
    if chunks[0].ByteSize() + chunks[1].ByteSize() <= max_bytes:
        chunks[1].tensor_part += b"\x00" * max_bytes  # the first part always exceeds the limit
    with pytest.raises(Oversized, match=f"exceeds {max_bytes} bytes"):
        _read(chunks, max_bytes=max_bytes)


def test_read_stream_gives_up_on_a_frozen_sender():
    async def frozen():
        yield swarm_pb2.Chunk(head=b"h")
        await asyncio.sleep(60)
        yield swarm_pb2.Chunk()

    with pytest.raises(TimeoutError, match="no next chunk within 0.1s"):
        asyncio.run(read_stream(frozen(), first_within=1.0, each_within=0.1, total_within=5.0, max_bytes=1 << 20))


_tensor_parts = st.one_of(
    st.binary(max_size=100),  # noise: a DecodeError at worst
    st.builds(
        lambda buffer, size, dtype, compression, grad: runtime_pb2.Tensor(
            buffer=buffer, size=size, dtype=dtype, compression=compression, requires_grad=grad
        ).SerializeToString(),
        st.binary(max_size=64),
        st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 16), max_size=3),
        st.sampled_from(["float32", "float16", "bfloat16", "int64", "bool", "", "object", "U4", "fhoat32", "complex64"]),
        st.integers(0, 7),
        st.booleans(),
    ),
    st.sampled_from([serialize_torch_tensor(torch.arange(6.0)).SerializeToString()]).flatmap(
        lambda blob: edits.map(lambda ops: mutate(blob, ops))
    ),
)


@fuzz(400, phases=[Phase.explicit, Phase.generate])
@given(parts=st.lists(_tensor_parts, min_size=1, max_size=3))
@example(parts=[b""])  # an empty Chunk after the header (hivemind would raise TypeError("data type '' ..."))
def test_read_stream_refuses_garbage_tensor_parts_only_with_its_documented_errors(parts):
    chunks = [swarm_pb2.Chunk(head=b"head")] + [swarm_pb2.Chunk(tensor_part=p) for p in parts]
    try:
        _read(chunks, max_bytes=1 << 20)
    except (TimeoutError, Oversized, WireRejected):
        pass


# ----- compressed butterfly parts (butterfly.reduce, butterfly.assemble) ------------------------------------------
BUTTERFLY_KINDS = ["fp16", "int8", "fp4", "topk"]
GROUP = 3


def _butterfly(kind: str) -> tuple[list, list[list[bytes]], list[tuple[int, int]], list[bytes]]:
    """A group of GROUP members' round: their RoundCodecs, parts[sender][reducer], the reducers' spans and the
    reduced parts, all valid (topk through the butterfly at every group size here)."""
    cfg = CompressionConfig(kind=kind, topk_chunk=16, topk_density=0.25, topk_transport="butterfly", block=16)
    generator = torch.Generator().manual_seed(1)
    rounds = [StageCodec(cfg, NAMES, SHAPES, run_id="fuzz").begin(ROUND, [torch.randn(s, generator=generator) * 1e-3
                                                                           for s in SHAPES]) for _ in range(GROUP)]  # fmt: skip
    messages = [r.message(1) for r in rounds]
    parts, spans = [cut_all(m, GROUP) for m in messages], part_spans(messages[0], GROUP)
    reduced = [reduce(rounds[k], [p[k] for p in parts], span=spans[k]).blob for k in range(GROUP)]
    return rounds, parts, spans, reduced


BUTTERFLIES = {kind: _butterfly(kind) for kind in BUTTERFLY_KINDS}


def _finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _butterfly_edits(rng) -> tuple[str, int, list[tuple]]:
    return rng.choice(BUTTERFLY_KINDS), rng.randrange(GROUP), byte_edits(rng)


def test_a_mutated_butterfly_part_is_reduced_with_the_others_or_refused_never_raised():
    check_each(800, _butterfly_edits, lambda case: _mutated_part(*case), seed=9)


def _mutated_part(kind: str, sender: int, ops: list[tuple]) -> None:
    rounds, parts, spans, reduced = BUTTERFLIES[kind]
    mine = [p[1] for p in parts]  # reducer 1's span of each member's message
    mine[sender] = mutate(mine[sender], ops)
    with small_slices():
        out = reduce(rounds[1], mine, span=spans[1])
        assert (sender in out.rejected) != (sender in out.used)
        assert set(out.used) | set(out.rejected) == set(range(GROUP))
        assembled = assemble(rounds[0], [reduced[0], out.blob, reduced[2]], spans=spans, own=0)
    assert not assembled.refused and _finite(assembled.tensors)  # what a reducer serves always assembles, finite


def test_a_mutated_reduced_part_is_assembled_or_refused_never_raised():
    check_each(1100, _butterfly_edits, lambda case: _mutated_reduced_part(*case), seed=10)


def _mutated_reduced_part(kind: str, reducer: int, ops: list[tuple]) -> None:
    rounds, _, spans, reduced = BUTTERFLIES[kind]
    blobs = list(reduced)
    blobs[reducer] = mutate(blobs[reducer], ops)
    with small_slices():
        assembled = assemble(rounds[(reducer + 1) % GROUP], blobs, spans=spans, own=(reducer + 1) % GROUP)
    assert set(assembled.refused) <= {reducer} and _finite(assembled.tensors)
    if reducer in assembled.refused:  # its span is missing (in unpadded coordinates), nothing of it applied
        assert assembled.missing
