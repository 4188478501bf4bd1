"""Proof that a reducer of a butterfly sent members of its group different bytes.

A reducer serves its reduced part of a round behind a MessageDigest it signs (group, phase, part,
size, SHA-256; in the fp32 butterfly one for its whole averaged span: allreduce.py), and every member
keeps the digests of the reduced parts its copy of the average was assembled from. In phase 5 each member announces them with its copy's hash (AverageRecord),
so a member reading the others' records holds every digest of the group: two that one reducer
signed for the same group, phase and part with different SHA-256 are a proof that it
equivocated, which nobody but that reducer could have made. Digests that do not open (forged,
another run, banned signer) prove nothing and are skipped: a member cannot frame a reducer.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..envelope import Gate
from ..errors import WireRejected
from ..proto_gen import envelope_pb2

__all__ = ["equivocators"]


def equivocators(gate: Gate, group_id: bytes, digests: Iterable[bytes]) -> dict[str, str]:
    """The reducers that signed two different digests for one part of one phase of group `group_id`, each with
    the proof in words: {peer id: "..."}. `digests`: every signed digest at hand (this member's and the ones the
    others announced), in any order."""
    seen: dict[tuple[str, int, int], bytes] = {}
    proven: dict[str, str] = {}
    for blob in digests:
        try:
            opened = gate.open(blob, envelope_pb2.MessageDigest, even_banned=True)
        except WireRejected:
            continue
        digest = opened.message
        if digest.group_id != group_id:
            continue
        key = (opened.sender, digest.phase, digest.part)
        first = seen.setdefault(key, digest.sha256)
        if first != digest.sha256 and opened.sender not in proven:
            proven[opened.sender] = (
                f"it signed two different reduced parts for phase {digest.phase} part {digest.part} of one group "
                f"(SHA-256 {first.hex()[:12]} and {digest.sha256.hex()[:12]}): it sent members different bytes"
            )
    return proven
