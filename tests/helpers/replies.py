"""A donor and an asker of signed replies, and the alterations a link may make, for the reply fuzz tests
(tests/unit/test_fuzz_replies.py, tests/unit/test_fuzz_state_replies.py): the reply side of a one-fragment stage's
averager (DilocoxAverager's mixins) without its process and DHT, in a closed run that admits both.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dilocox_p2p.envelope import Gate, Policy, Signer
from dilocox_p2p.identity import certify_worker, peer_id_of, public_raw
from dilocox_p2p.swarm.held import AverageService
from dilocox_p2p.swarm.transfer import SignedReplies
from dilocox_p2p.wire import swarm_pb2
from tests.helpers.seeded import position

__all__ = ["LOOP", "RUN", "SHAPES", "Worker", "chunk_edits", "edited", "parsed", "stream", "sweep_bit_flips"]

RUN = "fuzz-replies"
SHAPES = [torch.Size((5, 4)), torch.Size((7,)), torch.Size((3, 3))]
LOOP = asyncio.new_event_loop()  # one for every case (a new loop per case was most of a case's time)


def _key(name: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(name.encode()).digest())


def _signer(name: str) -> Signer:
    worker, peer = _key(f"worker {name}"), _key(f"peer {name}")
    return Signer(worker, certify_worker(peer, peer_id_of(worker), run_id=RUN, stage=0, peer_name=name))


class Worker(AverageService, SignedReplies):
    """The reply side of a one-fragment stage's averager (DilocoxAverager's mixins), without its process and DHT."""

    def __init__(self, name: str):
        self.signer, self.stage = _signer(name), 0
        self.gate = Gate(Policy(run_id=RUN, closed=True, allowlist=frozenset(
            public_raw(_key(f"peer {n}")) for n in ("donor", "asker"))))  # fmt: skip
        self._averaged_tensors = [torch.zeros(s) for s in SHAPES]

    def _of_round(self, round: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)


def parsed(chunks: list[bytes]) -> list[swarm_pb2.Chunk]:
    """The chunks whose bytes still parse (a chunk that no longer does is dropped, as a stream would drop it)."""
    out = []
    for blob in chunks:
        try:
            out.append(swarm_pb2.Chunk.FromString(blob))
        except Exception:
            continue
    return out


def sweep_bit_flips(served: list[bytes], verdict: Callable[[list[bytes]], tuple[bool, str]]) -> tuple[int, int]:
    """`verdict` (taken or not, and why not; it checks what was taken itself) of `served` with one bit flipped: each
    byte's lowest, then its highest, every one in turn (exhaustive). Every refusal must say why. Returns (cases,
    refused)."""
    cases = refused = 0
    for i, blob in enumerate(served):
        for j in range(len(blob)):
            for bit in (0x01, 0x80):
                chunks = list(served)
                chunks[i] = blob[:j] + bytes([blob[j] ^ bit]) + blob[j + 1 :]
                taken, reason = verdict(chunks)
                cases += 1
                if not taken:
                    assert reason, "refused without a reason"
                    refused += 1
    return cases, refused


async def stream(chunks: list[swarm_pb2.Chunk]):
    for chunk in chunks:
        yield chunk


def edited(chunks: list[bytes], edits: list[tuple]) -> list[bytes]:
    """`chunks` with each of `edits` (one of `ops`' draws) made in turn."""
    for op in edits:
        chunks = edit(chunks, op)
    return chunks


def edit(chunks: list[bytes], op: tuple) -> list[bytes]:
    """`chunks` with one alteration `op` (one of `ops`' draws): a chunk dropped, duplicated, swapped with the next,
    a byte changed, or cut short."""
    kind, which, where, value = op
    out = list(chunks)
    i = int(which * len(out)) if out else 0
    if kind == "drop" and out:
        del out[i]
    elif kind == "duplicate" and out:
        out.insert(i, out[i])
    elif kind == "swap" and len(out) > 1:
        j = (i + 1) % len(out)
        out[i], out[j] = out[j], out[i]
    elif kind == "byte" and out:
        blob = bytearray(out[i])
        if blob:
            blob[int(where * len(blob))] ^= value or 1
        out[i] = bytes(blob)
    elif kind == "cut" and out:
        out[i] = out[i][: int(where * len(out[i]))]
    return out


def chunk_edits(rng: random.Random) -> list[tuple]:
    """1 to 3 alterations of a reply for `edited`, drawn from `rng` (tests/helpers/seeded.py)."""
    return [(rng.choice(("drop", "duplicate", "swap", "byte", "cut")), position(rng), position(rng), rng.randrange(256))
            for _ in range(rng.randint(1, 3))]  # fmt: skip
