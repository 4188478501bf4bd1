"""Reply handlers fuzzed end to end: a donor's real signed reply (its header and tensor parts, as its handler
streams them), altered on the way, read by the asking worker's real reply path (`read_stream`, then
`AverageService._average_reply`: the header's signature and nonce, the tensors' shapes, SHA-256, finiteness, the
header's kind and spans). Whatever arrives, the asker takes exactly the tensors the donor signed or refuses the
reply with a reason; nothing raises. Derandomized, part of the fuzz cases of issue 38 (state replies, whole and
in pieces: test_fuzz_state_replies.py; the donor, asker and alterations: tests/helpers/replies.py).

    pytest tests/unit/test_fuzz_replies.py -q
"""

from __future__ import annotations

import pytest
import torch

from dilocox_p2p.average import AverageKind
from dilocox_p2p.errors import WireRejected
from dilocox_p2p.swarm.held import HeldAverage
from dilocox_p2p.swarm.transfer import Oversized, claimed_nonce, read_stream
from dilocox_p2p.wire import swarm_pb2
from tests.helpers.seeded import check_each
from tests.helpers.replies import LOOP, RUN, SHAPES, Worker, chunk_edits, edited, parsed, stream, sweep_bit_flips

pytestmark = pytest.mark.unit

ROUND = 6

DONOR, ASKER = Worker("donor"), Worker("asker")
TENSORS = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]
REQUEST = ASKER.signer.seal_message(swarm_pb2.AverageRequest(run_id=RUN, stage=0, round=ROUND, wait_s=1.0),
                                    topic=DONOR.signer.worker_id, round=ROUND)  # fmt: skip


COUNTED_BY = ((DONOR.signer.worker_id,), None)  # reducer 0 averaged the donor alone; reducer 1's span: not known


def _served() -> list[bytes]:
    """The donor's reply to REQUEST, chunk by chunk, as its rpc_download_average streams it."""
    held = HeldAverage(ROUND, AverageKind.PARTIAL, TENSORS, ((3, 9),), (ASKER.signer.worker_id, DONOR.signer.worker_id),
                       b"group", COUNTED_BY)  # fmt: skip
    chunks, digest = DONOR._tensor_chunks(held.tensors)
    header = swarm_pb2.AverageHeader(status=swarm_pb2.STATE_OK, average=held.info(), n_tensors=len(TENSORS), sha256=digest)
    return [c.SerializeToString() for c in [DONOR._head(header, nonce=claimed_nonce(REQUEST)), *chunks]]


SERVED = _served()


def _asked(chunks: list[bytes]) -> tuple[HeldAverage | None, str]:
    """What the asker makes of these chunks (a chunk whose bytes no longer parse is dropped, as a stream would)."""
    try:
        reply = LOOP.run_until_complete(read_stream(stream(parsed(chunks)), first_within=5.0, each_within=5.0,
                                                    total_within=10.0, max_bytes=ASKER._tensor_bytes(1)))  # fmt: skip
    except (WireRejected, Oversized) as e:
        return None, f"refused: {e}"
    got, reason, _ = ASKER._average_reply(reply, REQUEST, DONOR.signer.worker_id, ROUND)
    return got, reason


def _verdict(chunks: list[bytes]) -> tuple[bool, str]:
    """Whether the asker took the reply (then exactly what the donor signed: asserted here), and why not."""
    got, reason = _asked(chunks)
    if got is not None:
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, TENSORS)) and len(got.tensors) == len(TENSORS)
        assert got.kind is AverageKind.PARTIAL and got.missing == ((3, 9),) and got.group_id == b"group"
        assert got.counted_by == COUNTED_BY
    return got is not None, reason


def test_the_donors_reply_as_served_is_taken_whole():
    got, reason = _asked(SERVED)
    assert got is not None, reason
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, TENSORS)) and got.missing == ((3, 9),)
    assert got.counted_by == COUNTED_BY, "whom each reducer counted travels with the copy"


def test_every_single_bit_flip_of_the_served_reply_is_refused_or_changes_nothing_signed():
    # exhaustive, not sampled: each of the reply's 771 bytes with its lowest and its highest bit flipped (1,542
    # cases, a plain loop: a case costs a fraction of a hypothesis example's)
    cases, refused = sweep_bit_flips(SERVED, _verdict)
    assert cases == 2 * sum(map(len, SERVED)) and refused > 0.9 * cases, (cases, refused)


def test_an_altered_average_reply_is_taken_exactly_as_signed_or_refused_with_a_reason():
    def check(edits: list[tuple]) -> None:
        taken, reason = _verdict(edited(SERVED, edits))  # taken: exactly what the donor signed (_verdict checks it)
        assert taken or reason, "refused without a reason"

    check_each(1600, chunk_edits, check, seed=201)
