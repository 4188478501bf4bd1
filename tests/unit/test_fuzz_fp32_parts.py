"""A part of the fp32 butterfly fuzzed end to end: a sender's real part (its tensor bytes, behind the MessageDigest it
signs in AveragingData.peer_id, as `ExactAllReduceRunner._generate_input_for_peer` sends it), altered on the way, read
by a reducer's real checks (allreduce.read_part, `_misfit`, digest_refusal: the digest's signature and author, its
group, phase and part, the bytes' size and SHA-256). Whatever arrives, the reducer takes exactly the values the sender
signed or refuses the part with a reason; nothing raises. Derandomized, part of the fuzz cases of issue 38 (an
averaged span is checked by the same functions against its reducer's digest).

    pytest tests/unit/test_fuzz_fp32_parts.py -q
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.proto import averaging_pb2

from dilocox_p2p.proto_gen import envelope_pb2
from dilocox_p2p.swarm.allreduce import PART_BITS, SENT_PHASE, ExactAllReduceRunner, digest_refusal, read_part
from tests.helpers.seeded import check_each
from tests.helpers.replies import Worker, chunk_edits, edited, sweep_bit_flips

pytestmark = pytest.mark.unit

GROUP, REDUCER, PART = b"group-of-round-4", 2, 1
SHAPE = torch.Size((40,))
SENDER, REDUCING = Worker("donor"), Worker("asker")
VALUES = torch.randn(SHAPE, generator=torch.Generator().manual_seed(38))
KEY = (GROUP, SENT_PHASE, REDUCER << PART_BITS | PART)


def _sent() -> bytes:
    """The sender's part as its runner sends it: the tensor, and its signed digest in peer_id."""
    message = averaging_pb2.AveragingData(tensor_part=serialize_torch_tensor(VALUES))
    buffer = message.tensor_part.buffer
    message.peer_id = SENDER.signer.seal(envelope_pb2.MessageDigest(
        group_id=GROUP, phase=SENT_PHASE, part=KEY[2], size=len(buffer), sha256=hashlib.sha256(buffer).digest()))  # fmt: skip
    return message.SerializeToString()


SENT = [_sent()]


def _checked(chunks: list[bytes]) -> tuple[torch.Tensor | None, str]:
    """What the reducer makes of the part (`chunks`: its one message, or none left)."""
    if len(chunks) != 1:
        return None, f"{len(chunks)} messages where one part was sent"
    try:
        message = averaging_pb2.AveragingData.FromString(chunks[0])
    except Exception as e:  # the stream's reader fails on it: the sender's stream ends, and it is banned
        return None, f"does not parse ({type(e).__name__})"
    tensor, why = read_part(message)
    why = why or ExactAllReduceRunner._misfit(tensor, [SHAPE], 0) or digest_refusal(
        REDUCING.gate, message.peer_id, author=SENDER.signer.worker_id, key=KEY, size=len(message.tensor_part.buffer),
        sha256=hashlib.sha256(message.tensor_part.buffer).digest())  # fmt: skip
    return (None, why) if why else (tensor, "")


def _verdict(chunks: list[bytes]) -> tuple[bool, str]:
    tensor, why = _checked(chunks)
    assert tensor is None or torch.equal(tensor, VALUES), "values other than the sender's were taken"
    return tensor is not None, why


def test_the_senders_part_as_sent_is_taken_whole():
    tensor, why = _checked(SENT)
    assert tensor is not None and torch.equal(tensor, VALUES), why


def test_a_part_signed_by_another_worker_or_for_another_part_is_refused():
    message = averaging_pb2.AveragingData.FromString(SENT[0])
    size, sha = len(message.tensor_part.buffer), hashlib.sha256(message.tensor_part.buffer).digest()
    assert "signed digest" in digest_refusal(REDUCING.gate, message.peer_id, author=REDUCING.signer.worker_id, key=KEY,
                                             size=size, sha256=sha)  # fmt: skip
    assert "replayed" in digest_refusal(REDUCING.gate, message.peer_id, author=SENDER.signer.worker_id,
                                        key=(GROUP, SENT_PHASE, KEY[2] + 1), size=size, sha256=sha)  # fmt: skip


def test_every_single_bit_flip_of_a_sent_part_is_refused_or_changes_nothing_signed():
    cases, refused = sweep_bit_flips(SENT, _verdict)
    assert cases == 2 * len(SENT[0]) and refused > 0.9 * cases, (cases, refused)


def test_an_altered_part_is_taken_exactly_as_signed_or_refused_with_a_reason():
    def check(edits: list[tuple]) -> None:
        taken, why = _verdict(edited(SENT, edits))
        assert taken or why, "refused without a reason"

    check_each(800, chunk_edits, check, seed=211)
