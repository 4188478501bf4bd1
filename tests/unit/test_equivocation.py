"""Proof of a reducer's equivocation (swarm/equivocation.py): two digests it signed for one part of one
group's phase, with different SHA-256, convict it; nothing else does.

    pytest tests/unit/test_equivocation.py -q
"""

from __future__ import annotations

import hashlib

import pytest

from dilocox_p2p import identity
from dilocox_p2p.envelope import Gate, Policy, Signer
from dilocox_p2p.proto_gen import envelope_pb2
from dilocox_p2p.swarm.equivocation import equivocators

pytestmark = pytest.mark.unit

RUN = "r"
GROUP = b"group-of-round-4"


def _signer(tmp_path, name: str) -> Signer:
    worker_key = identity.worker_identity(tmp_path / f"{name}.key")
    peer_key = identity.write_identity(tmp_path / f"{name}.pem")
    cert = identity.certify_worker(peer_key, identity.peer_id_of(worker_key), run_id=RUN, stage=0, peer_name=name)
    return Signer(worker_key, cert)


def _digest(signer: Signer, payload: bytes, *, group: bytes = GROUP, phase: int = 3, part: int = 0) -> bytes:
    digest = envelope_pb2.MessageDigest(group_id=group, phase=phase, part=part, size=len(payload),
                                        sha256=hashlib.sha256(payload).digest())  # fmt: skip
    return signer.seal(digest)


@pytest.fixture
def gate() -> Gate:
    return Gate(Policy(run_id=RUN))


def test_a_reducer_that_signed_two_different_reduced_parts_of_one_phase_is_proven_to_equivocate(tmp_path, gate):
    liar, honest = _signer(tmp_path, "liar"), _signer(tmp_path, "honest")
    held_by_one = [_digest(liar, b"mean A"), _digest(honest, b"mean B")]
    held_by_another = [_digest(liar, b"mean A with one bit flipped"), _digest(honest, b"mean B")]
    proven = equivocators(gate, GROUP, [*held_by_one, *held_by_another])
    assert list(proven) == [liar.worker_id]
    assert "two different reduced parts for phase 3 part 0" in proven[liar.worker_id]


def test_the_same_part_twice_other_phases_parts_groups_and_forgeries_prove_nothing(tmp_path, gate):
    reducer, forger = _signer(tmp_path, "reducer"), _signer(tmp_path, "forger")
    same = [_digest(reducer, b"mean"), _digest(reducer, b"mean")]
    other_phase = [_digest(reducer, b"P mean", phase=4), _digest(reducer, b"Q mean", phase=5)]
    other_part = [_digest(reducer, b"span 0", part=1), _digest(reducer, b"span 1", part=2)]
    other_group = [_digest(reducer, b"round 5's mean", group=b"group-of-round-5")]
    # a member cannot frame the reducer: a digest it alters no longer opens under the reducer's signature
    framed = bytearray(_digest(reducer, b"mean"))
    framed[-40] ^= 1
    not_its_own = [_digest(forger, b"another mean")]  # signed by the forger: the forger's digest, not the reducer's
    digests = [*same, *other_phase, *other_part, *other_group, bytes(framed), *not_its_own, b"not an envelope"]
    assert equivocators(gate, GROUP, digests) == {}
