"""A stage's state in pieces: how it is cut, how its hash is made of the pieces', and how a piece a donor serves is
checked before a joiner keeps it (swarm/state_pieces.py; joiners, donors, a liar and a stalled donor in a
network-namespace lab: tests/netns/test_state_donors.py).

Run: python -m pytest tests/unit/test_state_pieces.py -q
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from dilocox_p2p import injection
from dilocox_p2p.state import STATE_PIECES, digest_of_pieces, piece_digests, piece_ranges, state_hash, tensors_digest
from dilocox_p2p.swarm.state_pieces import checked_piece
from dilocox_p2p.swarm.transfer import Reply
from dilocox_p2p.wire import swarm_pb2

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "sizes", [[4] * 16, [100, 1, 1, 1], [1, 1, 1, 100], [5], [3, 3], [7, 0, 0, 7], list(range(1, 40)), []]
)
def test_pieces_cover_every_tensor_once_in_order_and_none_is_empty(sizes):
    ranges = piece_ranges(sizes)
    assert len(ranges) <= STATE_PIECES
    assert [i for a, b in ranges for i in range(a, b)] == list(range(len(sizes)))
    assert all(a < b for a, b in ranges)


def test_pieces_of_many_equal_tensors_hold_equal_bytes():
    assert piece_ranges([4] * 16) == [(2 * k, 2 * k + 2) for k in range(8)]
    sizes = [1000] * 24 + [10] * 8  # a piece ends where the running total reaches its share
    shares = [sum(sizes[a:b]) for a, b in piece_ranges(sizes)]
    assert max(shares) - min(shares) <= 1000


def test_the_state_hash_is_the_hash_of_its_piece_digests_and_each_digest_covers_its_piece():
    tensors = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(11)]
    digests = piece_digests(tensors)
    ranges = piece_ranges([t.numel() * 4 for t in tensors])
    assert len(digests) == len(ranges) > 1
    assert state_hash(tensors) == hashlib.sha256(b"".join(digests)).hexdigest() == digest_of_pieces(digests)
    for (a, b), digest in zip(ranges, digests, strict=True):
        raw = b"".join(t.numpy().tobytes() for t in tensors[a:b])
        assert digest == tensors_digest(tensors[a:b]) == hashlib.sha256(raw).digest()


def _served(tensors, k, *, digests=None, altered=False):
    """The header and reply of piece `k` as a donor serves it (transfer.py: the SHA-256 of the parts it streams)."""
    a, b = piece_ranges([t.numel() * t.element_size() for t in tensors])[k]
    piece = tensors[a:b]
    if altered:
        piece = [injection.flip_lowest_bit(piece[0]), *piece[1:]]
    sent = hashlib.sha256(b"piece bytes").digest()
    header = swarm_pb2.StateHeader(status=swarm_pb2.STATE_OK, n_tensors=len(piece), sha256=sent,
                                   piece_digests=digests if digests is not None else piece_digests(tensors))  # fmt: skip
    return header, Reply(head=b"", tensors=piece, size=1000, sha256=sent), tensors[a:b]


def test_a_piece_is_kept_only_if_its_digests_make_the_majoritys_hash_and_its_bytes_its_digest():
    tensors = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(9)]
    want, n = state_hash(tensors), len(piece_ranges([64] * 9))
    header, reply, like = _served(tensors, 2)
    piece, why = checked_piece("donor", 2, header, reply, like, n, want)
    assert piece is not None and why == "" and piece.tensors == reply.tensors

    header, reply, like = _served(tensors, 2, altered=True)  # a lying donor: other bytes behind the honest list
    assert "does not match its digest" in checked_piece("liar", 2, header, reply, like, n, want)[1]

    other = [t + 1 for t in tensors]  # a donor that holds another state, and says so truthfully
    header, reply, like = _served(other, 2)
    assert "do not make the majority's state hash" in checked_piece("stale", 2, header, reply, like, n, want)[1]

    lie = piece_digests(tensors)
    lie[2] = tensors_digest(_served(tensors, 2, altered=True)[1].tensors)  # a list made to fit its altered piece
    header, reply, like = _served(tensors, 2, digests=lie, altered=True)
    assert "do not make the majority's state hash" in checked_piece("liar", 2, header, reply, like, n, want)[1]

    header, reply, like = _served(tensors, 2)
    reply.sha256 = b"\0" * 32  # altered on the way, after the donor signed
    assert "altered on the way" in checked_piece("link", 2, header, reply, like, n, want)[1]
    header, reply, _ = _served(tensors, 2)
    assert "do not fit this stage" in checked_piece("donor", 2, header, reply, [t.reshape(-1) for t in like], n, want)[1]
