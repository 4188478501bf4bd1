"""The gather's reply path fuzzed end to end: a member's real answer to a request for a compressed message (its
author's signed digest, then the message in payload parts, as `MessageGather.rpc_download_message` streams them),
altered on the way, read by the asking member's real reply path (`MessageReply.read`, then
`MessageGather._pulled`: the digest's signature and author, its group, phase and part, the bytes' size and SHA-256).
Whatever arrives, the asker takes exactly the bytes the author signed or refuses the reply with a reason; nothing
raises. Derandomized, part of the fuzz cases of issue 38 (the average's reply: test_fuzz_replies.py; the state's:
test_fuzz_state_replies.py).

    pytest tests/unit/test_fuzz_message_replies.py -q
"""

from __future__ import annotations

import pytest
import torch

from dilocox_p2p.compression.codec import StageCodec
from dilocox_p2p.config import CompressionConfig
from dilocox_p2p.errors import WireRejected
from dilocox_p2p.proto_gen import envelope_pb2
from dilocox_p2p.swarm.gather import PAYLOAD_PART, MessageGather, MessageReply
from dilocox_p2p.wire import swarm_pb2
from tests.helpers.seeded import check_each
from tests.helpers.replies import LOOP, RUN, SHAPES, Worker, chunk_edits, edited, parsed, stream, sweep_bit_flips

pytestmark = pytest.mark.unit

GROUP, PHASE, PART = b"group-of-round-4", 1, 0


class _Member(MessageGather, Worker):
    """The gather side of a one-fragment stage's averager, without its process and DHT."""


AUTHOR, ASKER = _Member("donor"), _Member("asker")
DELTA = [torch.randn(s, generator=torch.Generator().manual_seed(40 + i)) for i, s in enumerate(SHAPES)]
MESSAGE = StageCodec(CompressionConfig(kind="int8"), [f"t{i}" for i in range(len(SHAPES))], SHAPES,
                     run_id=RUN).begin(4, DELTA).message(1)  # fmt: skip
REQUEST = ASKER.signer.seal_message(swarm_pb2.GatherRequest(run_id=RUN, stage=0, group_id=GROUP, phase=PHASE,
                                                            sender=AUTHOR.signer.worker_id, wait_s=1.0, part=PART),
                                    topic=AUTHOR.signer.worker_id)  # fmt: skip
NONCE = envelope_pb2.Envelope.FromString(REQUEST.body).nonce


def _served() -> list[bytes]:
    """The author's answer to REQUEST for its own message, chunk by chunk, as rpc_download_message streams it."""
    digest = AUTHOR._sealed_digest(GROUP, PHASE, PART, MESSAGE)
    chunks = [swarm_pb2.Chunk(head=digest)]
    chunks += [swarm_pb2.Chunk(payload=MESSAGE[a : a + PAYLOAD_PART]) for a in range(0, len(MESSAGE), PAYLOAD_PART)]
    return [c.SerializeToString() for c in chunks]


SERVED = _served()


def _pulled(chunks: list[bytes]) -> tuple[bytes | None, str]:
    """What the asker makes of these chunks (a chunk that no longer parses is dropped, as a stream would)."""
    reply = MessageReply()
    try:
        LOOP.run_until_complete(reply.read(stream(parsed(chunks)), len(MESSAGE) + 65536))
    except WireRejected as e:
        return None, f"refused: {e}"
    got, reason = ASKER._pulled(reply, holder=AUTHOR.signer.worker_id, sender=AUTHOR.signer.worker_id,
                                key=(GROUP, PHASE, PART), nonce=NONCE)  # fmt: skip
    return (got[0] if got is not None else None), reason


def _verdict(chunks: list[bytes]) -> tuple[bool, str]:
    """Whether the asker took the message (then exactly the author's bytes: asserted here), and why not."""
    got, reason = _pulled(chunks)
    assert got is None or got == MESSAGE, "bytes other than the author's were taken"
    return got is not None, reason


def test_the_authors_message_as_served_is_taken_whole():
    got, reason = _pulled(SERVED)
    assert got == MESSAGE, reason
    assert len(MESSAGE) > 100, "a message too small to test"


def test_every_single_bit_flip_of_a_served_message_is_refused_or_changes_nothing_signed():
    cases, refused = sweep_bit_flips(SERVED, _verdict)
    assert cases == 2 * sum(map(len, SERVED)) and refused > 0.9 * cases, (cases, refused)


def test_an_altered_message_reply_is_taken_exactly_as_signed_or_refused_with_a_reason():
    def check(edits: list[tuple]) -> None:
        taken, reason = _verdict(edited(SERVED, edits))
        assert taken or reason, "refused without a reason"

    check_each(800, chunk_edits, check, seed=221)
