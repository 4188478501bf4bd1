"""State replies fuzzed end to end: a donor's real signed reply to a state request (its header and tensor parts, as
`StateService.rpc_download_round` streams them: a whole state with its pending average, or one piece of it cut by
the donor's own `_piece_of`), altered on the way, read by the asking worker's real reply path (`read_stream`, the
header's signature and nonce in answer to the request, then `StateService._state_from` for a whole state or
`state_pieces.checked_piece` for a piece: shapes, SHA-256, the piece digests against the majority's state hash).
Whatever arrives, the asker takes exactly the state the donor signed or refuses the reply with a reason; nothing
raises. Derandomized, part of the fuzz cases of issue 38 (the average's reply: test_fuzz_replies.py).

    pytest tests/unit/test_fuzz_state_replies.py -q
"""

from __future__ import annotations

import pytest
import torch

from dilocox_p2p.average import AverageKind
from dilocox_p2p.errors import WireRejected
from dilocox_p2p.state import piece_ranges, state_hash
from dilocox_p2p.swarm.state_pieces import checked_piece
from dilocox_p2p.swarm.state_service import StateDownload, StateService
from dilocox_p2p.swarm.transfer import Oversized, claimed_nonce, read_stream
from dilocox_p2p.wire import swarm_pb2
from tests.helpers.seeded import check_each
from tests.helpers.replies import LOOP, RUN, SHAPES, Worker, chunk_edits, edited, parsed, stream, sweep_bit_flips

pytestmark = pytest.mark.unit

BOUNDARY, PIECE = 9, 1


class _StateWorker(StateService, Worker):
    """The state side of a one-fragment stage's averager, without its process and DHT."""


DONOR, ASKER = _StateWorker("donor"), _StateWorker("asker")
THETA = [torch.randn(s, generator=torch.Generator().manual_seed(10 + i)) for i, s in enumerate(SHAPES)]
MOMENTUM = [torch.randn(s, generator=torch.Generator().manual_seed(20 + i)) for i, s in enumerate(SHAPES)]
PENDING = [torch.randn(s, generator=torch.Generator().manual_seed(30 + i)) for i, s in enumerate(SHAPES)]
STATE = [*THETA, *MOMENTUM]
HASH = state_hash(STATE)
RANGES = piece_ranges([t.numel() * t.element_size() for t in STATE])
METADATA = {"boundary": BOUNDARY, "state_hash": HASH,
            "pending": {"round": BOUNDARY - 1, "kind": AverageKind.PARTIAL.value, "missing": [(2, 5)], "group": ["a", "b"]}}  # fmt: skip


def _request(part: int, piece: int = 0):
    request = swarm_pb2.StateRequest(run_id=RUN, stage=0, boundary=BOUNDARY, wait_s=1.0, part=part, piece=piece)
    return ASKER.signer.seal_message(request, topic=DONOR.signer.worker_id, round=BOUNDARY)


WHOLE, PIECE_REQUEST = _request(swarm_pb2.STATE_OK), _request(swarm_pb2.STATE_PIECE, PIECE)


def _served(request, metadata, tensors, digests=()) -> list[bytes]:
    """The donor's reply, chunk by chunk, with the header rpc_download_round makes of `metadata` and `tensors`."""
    chunks, digest = DONOR._tensor_chunks(tensors)
    header = swarm_pb2.StateHeader(status=swarm_pb2.STATE_OK, boundary=metadata["boundary"],
                                   state_hash=metadata["state_hash"], n_tensors=len(tensors),
                                   has_pending=metadata["pending"] is not None, sha256=digest,
                                   pending_follows=metadata.get("follows", -1) >= 0, piece_digests=digests)  # fmt: skip
    if header.pending_follows:
        header.pending.CopyFrom(swarm_pb2.AverageInfo(round=metadata["follows"]))
    if (p := metadata["pending"]) is not None:
        header.pending.CopyFrom(swarm_pb2.AverageInfo(round=p["round"], kind=p["kind"], group=p["group"],
                                                      missing=[swarm_pb2.Span(start=a, end=b) for a, b in p["missing"]]))  # fmt: skip
    return [c.SerializeToString() for c in [DONOR._head(header, nonce=claimed_nonce(request)), *chunks]]


SERVED_WHOLE = _served(WHOLE, METADATA, [*STATE, *PENDING])
SERVED_PIECE = _served(PIECE_REQUEST, *DONOR._piece_of(METADATA, [*STATE, *PENDING], PIECE))


def _read(chunks: list[bytes], request, max_bytes: int):
    """The asker's read of these chunks and its opening of the signed header (a chunk that no longer parses is
    dropped, as a stream would): (header, reply), or raises what the asker's `_ask_state` raises."""
    reply = LOOP.run_until_complete(read_stream(stream(parsed(chunks)), first_within=5.0, each_within=5.0, total_within=10.0,
                                                max_bytes=max_bytes))  # fmt: skip
    return ASKER._open_head(reply, swarm_pb2.StateHeader, DONOR.signer.worker_id, request), reply


def _whole(chunks: list[bytes]) -> StateDownload:
    try:
        header, reply = _read(chunks, WHOLE, ASKER._tensor_bytes(3))
    except (WireRejected, Oversized) as e:
        return StateDownload(status=-1, boundary=-1, donor="", reason=f"refused: {e}")
    return ASKER._state_from(header, reply, DONOR.signer.worker_id, swarm_pb2.STATE_OK)


def _piece(chunks: list[bytes]):
    a, b = RANGES[PIECE]
    try:
        header, reply = _read(chunks, PIECE_REQUEST, ASKER._tensor_bytes(1))
    except (WireRejected, Oversized) as e:
        return None, f"refused: {e}"
    return checked_piece(DONOR.signer.worker_id, PIECE, header, reply, STATE[a:b], len(RANGES), HASH)


def _as_signed(got: StateDownload) -> bool:
    """Whether a taken state is exactly the one the donor signed."""
    state = got.state
    assert state is not None and state.pending is not None
    pending = state.pending.average
    return (got.status == swarm_pb2.STATE_OK and got.boundary == BOUNDARY and got.state_hash == HASH
            and all(torch.equal(a, b) for a, b in zip([*state.theta_g, *state.momentum], STATE, strict=True))
            and all(torch.equal(a, b) for a, b in zip(pending.tensors, PENDING, strict=True))
            and state.pending.round == BOUNDARY - 1 and pending.kind is AverageKind.PARTIAL
            and pending.missing == ((2, 5),) and pending.group == ("a", "b"))  # fmt: skip


def _whole_verdict(chunks: list[bytes]) -> tuple[bool, str]:
    """Whether the asker took the whole state (then exactly the one signed: asserted here), and why not."""
    got = _whole(chunks)
    assert got.state is None or _as_signed(got), "a state other than the one signed was taken"
    return got.state is not None, got.reason


def _piece_verdict(chunks: list[bytes]) -> tuple[bool, str]:
    """Whether the asker kept the piece (then exactly the one signed: asserted here), and why not."""
    piece, why = _piece(chunks)
    a, b = RANGES[PIECE]
    assert piece is None or all(torch.equal(x, y) for x, y in zip(piece.tensors, STATE[a:b], strict=True))
    return piece is not None, why


def test_the_donors_whole_state_and_piece_as_served_are_taken_whole():
    got = _whole(SERVED_WHOLE)
    assert got.state is not None and _as_signed(got), got.reason
    piece, why = _piece(SERVED_PIECE)
    a, b = RANGES[PIECE]
    assert piece is not None and why == "" and all(torch.equal(x, y) for x, y in zip(piece.tensors, STATE[a:b], strict=True))
    assert 0 < b - a < len(STATE), "the piece is the whole state: nothing of the cut was tested"


def test_every_single_bit_flip_of_a_served_state_or_piece_is_refused_or_changes_nothing_signed():
    # exhaustive, not sampled: each byte of both replies with its lowest and highest bit flipped
    for served, verdict in ((SERVED_WHOLE, _whole_verdict), (SERVED_PIECE, _piece_verdict)):
        cases, refused = sweep_bit_flips(served, verdict)
        assert cases == 2 * sum(map(len, served)) and refused > 0.9 * cases, (cases, refused)


def test_an_altered_whole_state_reply_is_taken_exactly_as_signed_or_refused_with_a_reason():
    def check(edits: list[tuple]) -> None:
        taken, reason = _whole_verdict(edited(SERVED_WHOLE, edits))
        assert taken or reason, "refused without a reason"

    check_each(800, chunk_edits, check, seed=231)


def test_an_altered_state_piece_is_kept_exactly_as_signed_or_refused_with_a_reason():
    def check(edits: list[tuple]) -> None:
        taken, reason = _piece_verdict(edited(SERVED_PIECE, edits))
        assert taken or reason, "refused without a reason"

    check_each(800, chunk_edits, check, seed=232)
