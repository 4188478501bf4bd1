"""A donor and an asker of signed replies, and the alterations a link may make, for the reply fuzz tests
(tests/unit/test_fuzz_replies.py, tests/unit/test_fuzz_state_replies.py): the reply side of a one-fragment stage's
averager (DilocoxAverager's mixins) without its process and DHT, in a closed run that admits both.
"""

from __future__ import annotations

import asyncio
import hashlib

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import strategies as st

from dilocox_p2p.envelope import Gate, Policy, Signer
from dilocox_p2p.identity import certify_worker, peer_id_of, public_raw
from dilocox_p2p.swarm.held import AverageService
from dilocox_p2p.swarm.transfer import SignedReplies
from dilocox_p2p.wire import swarm_pb2

__all__ = ["LOOP", "RUN", "SHAPES", "Worker", "edit", "ops", "stream"]

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


async def stream(chunks: list[swarm_pb2.Chunk]):
    for chunk in chunks:
        yield chunk


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


ops = st.lists(st.tuples(st.sampled_from(["drop", "duplicate", "swap", "byte", "cut"]), st.floats(0, 0.999),
                         st.floats(0, 0.999), st.integers(0, 255)), min_size=1, max_size=3)  # fmt: skip
