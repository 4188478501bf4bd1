#!/usr/bin/env python3
"""What the signed wire protocol costs a stage worker per outer round, against the round's time.

    python benchmarks/signing.py                                         # tiny, H=100, group of 3
    python benchmarks/signing.py --preset small --timed-steps 2 --name signing_small

Measured on this machine, in one run:

1. Micro costs (median over --reps calls, warm caches as in a running worker: the worker
   certificate's verdict and the peer id's public key are cached after the first envelope of a
   worker): `Signer.seal` and `Gate.open` of each message the protocol signs (DHT records,
   group tickets, message digests, requests, reply headers), `Gate.open(fresh=True)` of a
   request (the replay check), `EnvelopeValidator.validate` (the DHT node's check of a record
   it stores or a lookup returns), a cold open (caches cleared), an open in a closed run, and
   SHA-256 throughput (hashlib) over a large buffer.
2. The round's time: `dilocox-peer join --no-swarm` trains the preset for --timed-rounds rounds
   of --timed-steps inner steps; the last round's compute seconds (the first round warms up)
   are scaled to --inner-steps. The round time is the denominator of every share below (inner
   compute only, not the outer step or any wait: the smallest honest round time).
3. Real message sizes: stage --stage of the preset's --stages is built (model.build_stage) and
   a random pseudo-gradient goes through each codec (`StageCodec.begin(0, delta).message(1)`,
   low-rank also phase 2), with SHA-256 timed on each message itself.

Per round, a stage worker in a group of N = --peers members (counts derived from the code;
each an upper bound where the code leaves a choice):
    member record     sealed every dht.HEARTBEAT_S s, plus 3 immediate updates (the exchange's
                      averaging_round, set_state at the boundary and when the pending average
                      is in); read (N records opened) every HEARTBEAT_S s by the membership
                      thread, plus once when the exchange starts and every POLL_S s while it
                      waits --skew-s for the last member to start the round
    round record      sealed twice (the boundary's state hash, then the pending average's hash);
                      read once by the hash check (N records opened)
    DHT validator     every record stored is validated by each of min(num_replicas, N x stages)
                      DHT nodes (by symmetry: that many validations per record this worker
                      stores); every lookup validates the N records of each replica that answers
    group ticket      sealed once; opened for each other member (N-1), and again by the group's
                      leader for each follower's join request (N-1: counted as if this worker led)
    fp32 (none)       the butterfly's parts travel on libp2p's authenticated channels: nothing
                      signed or hashed by this project
    compressed        per phase (low-rank: 2): one MessageDigest sealed (SHA-256 of its own
                      message), N-1 GatherRequests sealed and N-1 opened (fresh), N-1 reply
                      headers sealed (serving) and N-1 opened, N-1 digests opened, N-1 received
                      messages hashed (the server hashes nothing when serving: the author's
                      digest travels with the message)
Not per round: the config record (sealed once per run; its cost is reported), and downloads
(an average when a round must be mended or borrowed, a state when joining): one average
download costs a request and a header each way plus SHA-256 of the fp32 tensors on both ends,
reported separately as `one_average_download_ms`. hivemind's own matchmaking records (bytes
subkeys) pass the validator after one msgpack decode, and are not counted.

The counts are linear in the round time T: reported per codec as a fixed part per round and a
part per second (heartbeats and member lookups), hence the round time below which the total
would reach 1% (`round_s_for_one_percent`). Signing runs in the heartbeat thread, the DHT and
averager processes, concurrently with training: the shares are CPU time over wall round time.
The machine's load average is recorded with the timings (other work on it slows both sides).

Writes benchmarks/results/<name>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402

CODECS = ["none", "fp16", "int8", "topk", "lowrank"]
HEARTBEAT_UPDATES = 3  # immediate member-record updates per round (module docstring)


# ----- the round's time ------------------------------------------------------------------------
def round_seconds(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Train the preset alone (real stage processes) and return the round's compute time, scaled to H."""
    run_dir = tmp / "run"
    cmd = [
        sys.executable, "-m", "dilocox_p2p.cli", "join", "--no-swarm", "--run-dir", str(run_dir),
        "--preset", args.preset, "--stages", str(args.stages), "--device", "cpu",
        "--rounds", str(args.timed_rounds), "--inner-steps", str(args.timed_steps),
        "--batch-size", str(args.batch_size), "--microbatches", str(args.microbatches),
        "--progress", "off", "--log-level", "warning", "--data-seed", "0",
        "--set", "data.val_batches=1",  # evaluation is not timed: keep it short
    ]  # fmt: skip
    print(f"timing {args.timed_rounds} rounds of {args.timed_steps} inner steps of {args.preset} ...", flush=True)
    load_before = os.getloadavg()
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_round = [r["seconds_compute"] for r in records]
    step_s = per_round[-1] / args.timed_steps
    return {
        "timed_rounds": args.timed_rounds,
        "timed_steps": args.timed_steps,
        "seconds_compute_per_timed_round": per_round,
        "inner_step_s": step_s,
        "round_s": step_s * args.inner_steps,
        "scaled": args.timed_steps != args.inner_steps,
        "note": (f"the last timed round's compute seconds / {args.timed_steps} steps x H={args.inner_steps}"
                 if args.timed_steps != args.inner_steps else "the last timed round's compute seconds (H steps)"),
        "tokens_per_s": records[-1]["tokens_per_s"],
        "params_whole_model": records[-1]["params"],
        "wall_s": wall,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
    }  # fmt: skip


# ----- micro costs -------------------------------------------------------------------------------
def median_us(fn: Callable[[int], Any], reps: int, warmup: int = 50) -> float:
    """Median microseconds of fn(i) over `reps` calls (each timed on its own), after `warmup` calls
    fn(reps), fn(reps + 1)... (every index is used once)."""
    for i in range(warmup):
        fn(reps + i)
    times = []
    for i in range(reps):
        t0 = time.perf_counter_ns()
        fn(i)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


class Fixture:
    """Two stage workers of one run (`me`, `other`), each with its peer key, certificate and signer."""

    def __init__(self, run_id: str, stage: int, peers: int):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from dilocox_p2p.envelope import Gate, Policy, Signer
        from dilocox_p2p.identity import certify_peer, certify_worker, peer_id_of, public_raw

        self.run_id, self.stage = run_id, stage
        self.run_key = Ed25519PrivateKey.generate()
        signers, ids = [], []
        for i in range(max(peers, 2)):
            peer_key, worker_key = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
            worker_id = peer_id_of(worker_key)
            cert = certify_worker(peer_key, worker_id, run_id=run_id, stage=stage, peer_name=f"host{i}.example:{run_id}")
            admission = certify_peer(self.run_key, public_raw(peer_key), run_id=run_id, note=f"peer {i}")
            signers.append((Signer(worker_key, cert), Signer(worker_key, cert, admission)))
            ids.append(worker_id)
        self.signer, self.other = signers[1][0], signers[0][0]  # `other` signs what `me` (signer) opens
        self.other_closed = signers[0][1]
        self.me, self.other_id, self.group = ids[1], ids[0], ids[:peers]
        self.Gate, self.Policy = Gate, Policy
        self.closed_policy = Policy(run_id=run_id, closed=True, run_key=public_raw(self.run_key))

    def gate(self, closed: bool = False):
        return self.Gate(self.closed_policy if closed else self.Policy(run_id=self.run_id))


def micro_costs(args: argparse.Namespace, fx: Fixture, config_json: str, config_hash: str) -> dict[str, Any]:
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer, get_dht_time

    from dilocox_p2p import identity
    from dilocox_p2p.proto_gen import envelope_pb2
    from dilocox_p2p.swarm.dht import EnvelopeValidator, run_keys
    from dilocox_p2p.wire import swarm_pb2

    reps, run_id, stage = args.reps, fx.run_id, fx.stage
    members_key = f"{run_id}:members:s{stage}"
    round_key = f"{run_id}:round:s{stage}:41"
    config_key = f"{run_id}:config:{config_hash}"
    group_id = DHTID.generate().to_bytes()
    sha = hashlib.sha256(b"x").digest()
    member = swarm_pb2.MemberRecord(
        run_id=run_id, config_hash=config_hash, stage=stage, boundary=41, state_ready=True, joined_at=get_dht_time(),
        peer_name=f"host0.example:{run_id}", training=True, averaging_round=41,
    )  # fmt: skip
    round_record = swarm_pb2.RoundRecord(
        boundary=41, state_hash=sha.hex(), pending_hash=sha.hex(), group_size=3, coverage=1.0, kind="averaged"
    )
    config_record = swarm_pb2.ConfigRecord(config_hash=config_hash, shared_json=config_json)
    ticket = envelope_pb2.GroupTicket(schema=sha)
    digest = envelope_pb2.MessageDigest(group_id=group_id, phase=1, size=123456, sha256=sha)
    sealed_digest = fx.other.seal(digest)
    gather_request = swarm_pb2.GatherRequest(
        run_id=run_id, config_hash=config_hash, stage=stage, group_id=group_id, phase=1, sender=fx.other_id, wait_s=60.0
    )
    average_request = swarm_pb2.AverageRequest(run_id=run_id, config_hash=config_hash, stage=stage, round=41, wait_s=10.0)
    nonce = os.urandom(16)
    gather_header = swarm_pb2.GatherHeader(status=swarm_pb2.STATE_OK, size=123456, digest=sealed_digest)
    average_header = swarm_pb2.AverageHeader(
        status=swarm_pb2.STATE_OK, n_tensors=30, sha256=sha,
        average=swarm_pb2.AverageInfo(round=41, kind="averaged", group=fx.group, group_id=group_id),
    )  # fmt: skip

    out: dict[str, Any] = {"seal_us": {}, "open_us": {}, "envelope_bytes": {}}

    def seal_and_open(name: str, message: Any, open_kwargs: dict, seal_kwargs: dict | None = None) -> bytes:
        seal_kwargs = seal_kwargs or {}
        out["seal_us"][name] = median_us(lambda i: fx.signer.seal(message, **seal_kwargs), reps)
        blob = fx.other.seal(message, **seal_kwargs)
        gate = fx.gate()
        out["open_us"][name] = median_us(lambda i: gate.open(blob, type(message), sender=fx.other_id, **open_kwargs), reps)
        out["envelope_bytes"][name] = len(blob)
        return blob

    member_blob = seal_and_open("MemberRecord", member, {"topic": members_key}, {"topic": members_key})
    at_round = {"topic": round_key, "round": 41}
    round_blob = seal_and_open("RoundRecord", round_record, at_round, at_round)
    seal_and_open("ConfigRecord", config_record, {"topic": config_key}, {"topic": config_key})
    seal_and_open("GroupTicket", ticket, {"round": 41}, {"round": 41})
    seal_and_open("MessageDigest", digest, {})
    seal_and_open("GatherHeader", gather_header, {"in_reply_to": nonce}, {"in_reply_to": nonce})
    seal_and_open("AverageHeader", average_header, {"in_reply_to": nonce}, {"in_reply_to": nonce})

    # requests: sealed as a SignedEnvelope (the nonce read back, as gather.py does); opened fresh (replay check)
    for name, request in (("GatherRequest", gather_request), ("AverageRequest", average_request)):
        def seal_request(i: int, request: Any = request) -> bytes:
            sealed = fx.signer.seal_message(request, topic=fx.other_id)
            return envelope_pb2.Envelope.FromString(sealed.body).nonce

        out["seal_us"][name] = median_us(seal_request, reps)
        sealed = [fx.other.seal_message(request, topic=fx.me) for _ in range(reps + 50)]  # distinct nonces
        gate = fx.gate()
        out["open_us"][f"{name} (fresh)"] = median_us(
            lambda i, cls=type(request): gate.open(sealed[i], cls, sender=fx.other_id, topic=fx.me, fresh=True), reps
        )
        out["envelope_bytes"][name] = sealed[0].ByteSize()

    # the DHT node's check of a record it stores or a lookup returns (hivemind RecordValidator)
    validator = EnvelopeValidator(fx.gate(), run_keys(run_id, config_hash))
    for name, key, blob in (("MemberRecord", members_key, member_blob), ("RoundRecord", round_key, round_blob)):
        record = DHTRecord(
            key=DHTID.generate(source=key).to_bytes(), subkey=MSGPackSerializer.dumps(fx.other_id),
            value=MSGPackSerializer.dumps(blob), expiration_time=get_dht_time() + 15,
        )  # fmt: skip
        assert validator.validate(record), "the validator refused a good record"
        out.setdefault("validate_us", {})[name] = median_us(lambda i, r=record: validator.validate(r), reps)

    # cold: the certificate verdict and the peer id's key not cached yet (a worker's first envelope)
    gate = fx.gate()

    def cold_open(i: int) -> None:
        identity._verified.cache_clear()
        identity.public_key_of.cache_clear()
        gate.open(member_blob, swarm_pb2.MemberRecord, sender=fx.other_id, topic=members_key)

    out["open_cold_us"] = {"MemberRecord": median_us(cold_open, max(reps // 4, 100))}
    # closed run: the sender's RunCertificate checked too (its verdict cached like the worker certificate's)
    closed_blob = fx.other_closed.seal(member, topic=members_key)
    closed = fx.gate(closed=True)
    out["open_closed_run_us"] = {
        "MemberRecord": median_us(
            lambda i: closed.open(closed_blob, swarm_pb2.MemberRecord, sender=fx.other_id, topic=members_key), reps
        )
    }
    return out


def sha256_gb_per_s(mib: int, repeats: int) -> dict[str, Any]:
    buf = os.urandom(1 << 20) * mib
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.sha256(buf).digest()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {"buffer_mib": mib, "repeats": repeats, "seconds_median": seconds, "gb_per_s": len(buf) / seconds / 1e9}


def hash_ms(blob: bytes, repeats: int) -> float:
    """Median milliseconds of SHA-256 over `blob` (as gather.py hashes a message)."""
    return median_us(lambda i: hashlib.sha256(blob).digest(), repeats, warmup=1) / 1e3


# ----- messages --------------------------------------------------------------------------------
def codec_messages(args: argparse.Namespace, run_id: str) -> tuple[dict[str, Any], int]:
    """Each codec's message(s) for a random pseudo-gradient of the stage, with their sizes and hash times."""
    import torch

    from dilocox_p2p.compression.codec import StageCodec
    from dilocox_p2p.config import PRESETS, CompressionConfig
    from dilocox_p2p.model import build_stage

    module = build_stage(PRESETS[args.preset], args.stages, args.stage, 0)
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for p in module.parameters()]
    params = sum(p.numel() for p in module.parameters())
    del module
    generator = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for kind in CODECS[1:]:
        delta = [torch.randn(s, generator=generator) * 1e-3 for s in shapes]
        codec = StageCodec(CompressionConfig(kind=kind), names, shapes, run_id=run_id)
        round_codec = codec.begin(0, delta)
        first = round_codec.message(1)
        messages = [first]
        if codec.phases == 2:  # the group's phase-1 messages (copies of this one) give phase 2's
            messages.append(round_codec.message(2, [first] + [bytes(bytearray(first)) for _ in range(args.peers - 1)]))
        out[kind] = {
            "phases": codec.phases,
            "message_bytes": [len(m) for m in messages],
            "sha256_ms": [hash_ms(m, args.hash_repeats) for m in messages],
        }
        print(f"  {kind:8s} message bytes {out[kind]['message_bytes']}, SHA-256 {out[kind]['sha256_ms']} ms", flush=True)
        del delta, codec, round_codec, messages, first
    return out, params


# ----- the per-round model ---------------------------------------------------------------------
def replicas(n_nodes: int) -> int:
    from hivemind.dht.node import DHTNode

    default = inspect.signature(DHTNode.create).parameters["num_replicas"].default
    return min(int(default), n_nodes)


def per_round(
    kind: str, args: argparse.Namespace, micro: dict[str, Any], messages: dict[str, Any], round_s: float
) -> dict[str, Any]:
    """Events of one round of a stage worker (module docstring), each with its count and measured cost."""
    from dilocox_p2p.swarm.dht import HEARTBEAT_S
    from dilocox_p2p.swarm.membership import POLL_S

    n, seal, open_, validate = args.peers, micro["seal_us"], micro["open_us"], micro["validate_us"]
    r = replicas(n * args.stages)
    beats = round_s / HEARTBEAT_S + HEARTBEAT_UPDATES
    member_lookups = round_s / HEARTBEAT_S + 1 + math.ceil(args.skew_s / POLL_S)
    round_lookups = 1
    round_stores = 2
    events: list[tuple[str, str, float, float]] = [  # (what, cost kind, count, us each)
        ("member record sealed (heartbeat)", "seal", beats, seal["MemberRecord"]),
        ("member records opened (lookups x N)", "open", member_lookups * n, open_["MemberRecord"]),
        ("round records sealed (state hash, pending hash)", "seal", round_stores, seal["RoundRecord"]),
        ("round records opened (hash check: N)", "open", round_lookups * n, open_["RoundRecord"]),
        ("DHT validator: records stored x replicas", "validate", (beats + round_stores) * r,
         (beats * validate["MemberRecord"] + round_stores * validate["RoundRecord"]) / (beats + round_stores)),
        ("DHT validator: lookups x replicas x N", "validate", (member_lookups + round_lookups) * r * n,
         (member_lookups * validate["MemberRecord"] + round_lookups * validate["RoundRecord"])
         / (member_lookups + round_lookups)),
        ("group ticket sealed", "seal", 1, seal["GroupTicket"]),
        ("group tickets opened (N-1, and N-1 as leader)", "open", 2 * (n - 1), open_["GroupTicket"]),
    ]  # fmt: skip
    hashed_bytes = 0
    if kind != "none":
        m = messages[kind]
        for phase in range(m["phases"]):
            p = f" (phase {phase + 1})" if m["phases"] == 2 else ""
            events += [
                (f"message digest sealed{p}", "seal", 1, seal["MessageDigest"]),
                (f"gather requests sealed{p}", "seal", n - 1, seal["GatherRequest"]),
                (f"gather requests opened, fresh{p}", "open", n - 1, open_["GatherRequest (fresh)"]),
                (f"gather reply headers sealed{p}", "seal", n - 1, seal["GatherHeader"]),
                (f"gather reply headers opened{p}", "open", n - 1, open_["GatherHeader"]),
                (f"message digests opened{p}", "open", n - 1, open_["MessageDigest"]),
                (f"SHA-256 of messages: own + N-1 received{p}", "hash", n, m["sha256_ms"][phase] * 1e3),
            ]
            hashed_bytes += n * m["message_bytes"][phase]
    rows = [{"event": e, "cost": c, "count": k, "us_each": u, "ms": k * u / 1e3} for e, c, k, u in events]
    by_cost = {c: sum(row["ms"] for row in rows if row["cost"] == c) for c in ("seal", "open", "validate", "hash")}
    total = sum(by_cost.values())
    return {
        "sealed": sum(row["count"] for row in rows if row["cost"] == "seal"),
        "opened": sum(row["count"] for row in rows if row["cost"] == "open"),
        "validated_by_dht": sum(row["count"] for row in rows if row["cost"] == "validate"),
        "hashed_bytes": hashed_bytes,
        **{f"{c}_ms": v for c, v in by_cost.items()},
        "total_ms": total,
        "percent_of_round": 100 * total / (1e3 * round_s) if round_s > 0 else math.inf,
        "events": rows,
    }


def one_download(micro: dict[str, Any], params: int, throughput: float) -> dict[str, Any]:
    """One average download (mending or borrowing): request and header sealed and opened, and SHA-256 of
    the fp32 tensor parts on both ends (server when signing its header, client when reading)."""
    signing_us = (micro["seal_us"]["AverageRequest"] + micro["open_us"]["AverageRequest (fresh)"]
                  + micro["seal_us"]["AverageHeader"] + micro["open_us"]["AverageHeader"])  # fmt: skip
    hashed = 2 * 4 * params
    hashing_ms = hashed / (throughput * 1e9) * 1e3
    signing_ms = signing_us / 1e3
    return {"hashed_bytes": hashed, "signing_ms": signing_ms, "hash_ms": hashing_ms, "total_ms": signing_ms + hashing_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--stage", type=int, default=0, help="the stage whose worker is counted")
    parser.add_argument("--peers", type=int, default=3, help="group size N")
    parser.add_argument("--inner-steps", type=int, default=100, help="H: inner steps per round")
    parser.add_argument("--timed-steps", type=int, default=None, help="inner steps timed per round (default: H)")
    parser.add_argument("--timed-rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--skew-s", type=float, default=1.0,
                        help="how long a worker waits for the group's last member to start the round")
    parser.add_argument("--reps", type=int, default=2000, help="calls per micro cost")
    parser.add_argument("--hash-repeats", type=int, default=5)
    parser.add_argument("--sha-mib", type=int, default=256)
    parser.add_argument("--name", default="signing")
    args = parser.parse_args()
    args.timed_steps = args.timed_steps or args.inner_steps
    started = time.perf_counter()

    from dilocox_p2p.config import config_hash, load_config, shared_fields

    cfg = load_config(overrides={"model.preset": args.preset, "model.stages": args.stages})
    run_id, chash = cfg.run.run_id, config_hash(cfg)

    with tempfile.TemporaryDirectory() as tmp:
        timing = round_seconds(args, Path(tmp))
    round_s = timing["round_s"]
    print(f"round: {round_s:.2f} s ({timing['inner_step_s'] * 1e3:.1f} ms per inner step, {timing['note']})", flush=True)

    print("micro costs ...", flush=True)
    load_micro = os.getloadavg()
    fx = Fixture(run_id, args.stage, args.peers)
    micro = micro_costs(args, fx, json.dumps(shared_fields(cfg), sort_keys=True), chash)
    sha = sha256_gb_per_s(args.sha_mib, 5)
    for what in ("seal_us", "open_us", "validate_us"):
        print(f"  {what}: " + ", ".join(f"{k} {v:.1f}" for k, v in micro[what].items()), flush=True)
    print(f"  open cold {micro['open_cold_us']['MemberRecord']:.1f} us, closed run "
          f"{micro['open_closed_run_us']['MemberRecord']:.1f} us; SHA-256 {sha['gb_per_s']:.2f} GB/s", flush=True)

    print(f"messages of stage {args.stage} of {args.stages} ...", flush=True)
    messages, params = codec_messages(args, run_id)

    results = {kind: per_round(kind, args, micro, messages, round_s) for kind in CODECS}
    for kind, r in results.items():  # the counts are linear in the round time: a fixed part and a part per second
        fixed = per_round(kind, args, micro, messages, 0.0)["total_ms"]
        per_s = (r["total_ms"] - fixed) / round_s
        r["fixed_ms_per_round"], r["ms_per_second_of_round"] = fixed, per_s
        r["round_s_for_one_percent"] = fixed / (10.0 - per_s) if per_s < 10.0 else math.inf
    print(f"\nper round of {round_s:.2f} s, stage {args.stage} of {args.stages}, {params:,} params, group of {args.peers}:")
    print(f"{'codec':8s} {'sealed':>7s} {'opened':>7s} {'DHT val.':>8s} {'hashed B':>12s} {'sign+verify ms':>15s} "
          f"{'hash ms':>8s} {'total ms':>9s} {'% round':>8s}")
    for kind, r in results.items():
        print(f"{kind:8s} {r['sealed']:7.1f} {r['opened']:7.1f} {r['validated_by_dht']:8.1f} {r['hashed_bytes']:12,d} "
              f"{r['seal_ms'] + r['open_ms'] + r['validate_ms']:15.2f} {r['hash_ms']:8.2f} {r['total_ms']:9.2f} "
              f"{r['percent_of_round']:7.3f}%")
    print("fixed ms per round + ms per second of round; round time at which the total reaches 1%:")
    for kind, r in results.items():
        print(f"  {kind:8s} {r['fixed_ms_per_round']:.2f} ms + {r['ms_per_second_of_round']:.2f} ms/s -> "
              f"1% at a {r['round_s_for_one_percent']:.2f} s round")
    download = one_download(micro, params, sha["gb_per_s"])
    config_once = {"seal_ms": micro["seal_us"]["ConfigRecord"] / 1e3, "open_ms": micro["open_us"]["ConfigRecord"] / 1e3}
    print(f"one average download (mend/borrow, not every round): {download['total_ms']:.2f} ms "
          f"({100 * download['total_ms'] / (1e3 * round_s):.3f}% of a round)")
    path = write_result(args.name, {
        "preset": args.preset, "stage": args.stage, "stages": args.stages, "stage_params": params,
        "group_size": args.peers, "inner_steps": args.inner_steps, "batch_size": args.batch_size,
        "microbatches": args.microbatches, "skew_s": args.skew_s, "reps": args.reps,
        "dht_replicas": replicas(args.peers * args.stages), "heartbeat_updates_per_round": HEARTBEAT_UPDATES,
        "round": timing, "micro": {**micro, "load_average_before": list(load_micro)}, "sha256": sha, "messages": messages,
        "per_round": results, "one_average_download_ms": download, "config_record_once_per_run": config_once,
        "bench_wall_s": time.perf_counter() - started,
    })  # fmt: skip
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
