"""A hostile DHT node for the trust tests: it joins a run and writes every kind of bad record.

    python -m tests.helpers.forger --initial-peers MADDR --run-id RUN --out forger.json --seconds 90

It runs a plain hivemind DHTNode in its own event loop (no validator: it reads raw values
and stores whatever it likes) with a valid identity of its own and three more ("third parties"). Each pass,
against the stage-0 workers it finds (the victims), it stores:

    wrong_key    a member record and round records under a victim's subkey, signed by itself
    majority     round records with a made-up state hash from the third parties (valid
                 signatures, but no member records: a forged majority)
    replayed     a victim's real round record of boundary b, stored under boundary b + 2
    oversized    a 200 kB value under the members key
    malformed    random bytes under the members key
    plain        a plain (non-dictionary) value over the members key
    other_run    a member record signed for another run

Passes repeat every second until --seconds pass or it is killed; `--out` holds the counts
of what was attempted, rewritten after every pass.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from dilocox_p2p.envelope import Signer
from dilocox_p2p.identity import certify_worker, peer_id_of, worker_identity, write_identity
from dilocox_p2p.proto_gen import envelope_pb2
from dilocox_p2p.wire import swarm_pb2

TTL_S = 30.0


def _signer(root: Path, name: str, run_id: str) -> Signer:
    worker_key = worker_identity(root / f"{name}.ed25519")
    peer_key = write_identity(root / f"{name}.pem")
    cert = certify_worker(peer_key, peer_id_of(worker_key), run_id=run_id, stage=0, peer_name=f"forger-{name}")
    return Signer(worker_key, cert)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _boundaries(raw_members: dict, mine: set[bytes]) -> dict[str, int]:
    """Victims' boundaries, read from their member records without checking anything but that the forger
    did not write the record itself (its own forgery under a victim's subkey outlives the victim's record
    in its own storage, and would hold the victim's boundary where it was when first forged)."""
    out = {}
    for subkey, item in raw_members.items():
        if _digest(item.value) in mine:
            continue
        try:
            body = envelope_pb2.Envelope.FromString(envelope_pb2.SignedEnvelope.FromString(item.value).body)
            out[subkey] = swarm_pb2.MemberRecord.FromString(body.payload).boundary
        except Exception:
            continue
    return out


async def attack(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="forger-"))
    me = _signer(root, "forger", args.run_id)
    third = [_signer(root, f"third{i}", args.run_id) for i in range(3)]
    stranger = _signer(root, "stranger", "another-run")
    node = await DHTNode.create(
        initial_peers=args.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        identity_path=str(root / "forger.ed25519"), check_if_identity_free=False,
    )  # fmt: skip
    run = args.run_id
    members_key = f"{run}:members:s0"
    counts = dict.fromkeys(["passes", "wrong_key", "majority", "replayed", "oversized", "malformed", "plain", "other_run"], 0)
    stores = []
    mine: set[bytes] = set()  # digests of every value it wrote, never mistaken for a victim's
    boundary_of: dict[str, int] = {}  # the newest boundary each victim announced
    real: dict[str, tuple[int, bytes]] = {}  # each victim's newest own round record seen: (boundary, value)

    def store(key: str, subkey: str | None, value: bytes, kind: str) -> None:
        mine.add(_digest(value))
        stores.append(node.store(key, value, get_dht_time() + TTL_S, subkey=subkey))
        counts[kind] += 1

    async def own_round_record(victim: str, boundary: int) -> tuple[int, bytes] | None:
        """The victim's own round record of an earlier boundary: the one of boundary - 1 if the DHT still
        returns it, else the newest seen in an earlier pass."""
        old = await node.get(f"{run}:round:s0:{boundary - 1}", latest=True)
        item = old.value.get(victim) if old is not None and isinstance(old.value, dict) else None
        if item is not None and _digest(item.value) not in mine:
            real[victim] = max(real.get(victim, (-1, b"")), (boundary - 1, item.value))
        return real.get(victim)

    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline and counts["passes"] < 300:
        found = await node.get(members_key, latest=True)
        raw = found.value if found is not None and isinstance(found.value, dict) else {}
        for victim, boundary in _boundaries(raw, mine).items():
            boundary_of[victim] = max(boundary, boundary_of.get(victim, 0))
        for victim, boundary in boundary_of.items():
            record = swarm_pb2.MemberRecord(run_id=run, stage=0, boundary=boundary, training=False)
            store(members_key, victim, me.seal(record, topic=members_key), "wrong_key")
            for b in (boundary, boundary + 1):
                key = f"{run}:round:s0:{b}"
                forged = swarm_pb2.RoundRecord(boundary=b, state_hash="f" * 64)
                store(key, victim, me.seal(forged, topic=key, round=b), "wrong_key")
                for signer in third:
                    store(key, signer.worker_id, signer.seal(forged, topic=key, round=b), "majority")
            old = await own_round_record(victim, boundary) if boundary >= 1 else None
            if old is not None:  # the victim's own record of an earlier boundary, replayed under a later one
                store(f"{run}:round:s0:{old[0] + 2}", victim, old[1], "replayed")
        store(members_key, me.worker_id, os.urandom(200_000), "oversized")
        store(members_key, me.worker_id, os.urandom(300), "malformed")
        store(members_key, None, b"not a dictionary", "plain")
        other = swarm_pb2.MemberRecord(run_id="another-run", stage=0, training=True)
        store(members_key, stranger.worker_id, stranger.seal(other, topic=members_key), "other_run")
        await asyncio.wait_for(asyncio.gather(*stores, return_exceptions=True), 30.0)
        stores.clear()
        counts["passes"] += 1
        Path(args.out).write_text(json.dumps(counts))
        await asyncio.sleep(0.5)
    await node.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=90.0)
    args = parser.parse_args()
    asyncio.run(attack(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
