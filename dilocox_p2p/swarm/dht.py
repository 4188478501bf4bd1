"""The DHT side of a stage worker: start the node, and read/write the run's records.

Keys (values are SignedEnvelopes (envelope.py) of protobuf messages from
proto/dilocox/v1/swarm.proto, signed by the worker whose peer id is the subkey, for the key
they are stored under):
    {run}:members:s{stage}        MemberRecord per live worker, refreshed by a heartbeat (heartbeat.py)
    {run}:round:s{stage}:{b}      RoundRecord: the state (and pending average) hashes each worker holds at b
    {run}:average:s{stage}:{r}    AverageRecord: the hash of round r's average each member of its group holds
    {run}:digests:s{stage}:{r}:{w}  DigestRecord: the reducers' signed digests worker w's copy of it was made from
                                  (a key per worker: a store walks to its key's nodes, which answer with what the
                                  key holds, and a shared key's N records of N digests each grew as N^2)
    {run}:config:{hash}           ConfigRecord: the shared config behind a hash

Records are checked twice: by the DHT node itself (`EnvelopeValidator` in record_rules.py, a hivemind
RecordValidator: a record signed by another key than its subkey's, for another key, run or
protocol, by a key a closed run does not admit, or expiring later than its signature allows, and
any plain value, is neither stored nor returned), and when
read (`RunRecords`: the same checks plus the payload's type, schema and round, with the
reason logged and counted as `records_refused`). A lookup that fails raises (the caller
counts it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import get_dht_time

from ..average import malformed_average
from ..config import SwarmConfig
from ..endpoints import loopback_only, stage_maddr
from ..envelope import ForeignProtocol, Gate, Opened, Signer
from ..errors import SwarmError, SwarmUnreachable, WireRejected
from ..identity import peer_id_of, worker_identity
from ..proto_gen import envelope_pb2
from ..wire import swarm_pb2
from .dht_join import join_any
from .dht_process import HelperDHT, dht_result, shutdown_whole
from .faults import FaultCounter
from .record_rules import (
    AVERAGE_RECORD_TTL_S,
    EXPIRY_SLACK_S,
    JOINED_FLOOR,
    MEMBER_TTL_S,
    ROUND_RECORD_TTL_S,
    EnvelopeValidator,
    run_keys,
)

__all__ = ["EnvelopeValidator", "Member", "RunRecords", "dht_result", "node_id_of", "run_keys", "start_dht"]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
JOIN_S = 8.0  # how long a node waits for one of its initial peers to listen (one still starting or restarting)
# A record is stored on its key's REPLICAS nearest DHT nodes (hivemind's num_replicas), and a walk to them asks
# each node it meets for the key's value: every member's record under it. hivemind walks a beam of 20 nodes
# (its bucket size) for a store and a get alike, so every node of a swarm of up to 20 answered every walk with
# every record (N^2 bytes per member and walk); a beam of REPLICAS finds the nodes that hold the records.
REPLICAS = 5
BEAM_SIZE = REPLICAS


def node_id_of(peer_id: str) -> DHTID:
    """The DHT node id of the node that runs under libp2p key `peer_id`: fixed by the key, as the peer id is.
    hivemind draws a random one at every start, and the others' routing tables kept the one of a node's
    previous life beside the new one, both leading to the same peer: a record stored reached that peer twice,
    the second copy was refused (a node keeps one copy of a record of one expiration), and where that answer
    came last the whole store read as failed ("no DHT node accepted it": after every restart, and after a
    join tried twice)."""
    return DHTID.generate(source=f"dilocox-dht-node:{peer_id}")


def start_dht(
    cfg: SwarmConfig,
    *,
    stage: int,
    identity_path: Path,
    validator: RecordValidatorBase,
    extra_peers: Sequence[str] = (),
    join_s: float = JOIN_S,
) -> hivemind.DHT:
    """Start this worker's DHT node (libp2p key: `identity_path`, identity.worker_identity) and join the swarm
    through whichever of its initial peers answers first (dht_join.py), linking `extra_peers` (this peer's own
    stage-0 node) at the same time (without initial peers: through `extra_peers`); errors name the failing
    address: SwarmUnreachable when none answered a try begun within `join_s` (dht_join.join_any)."""
    kwargs: dict[str, Any] = dict(
        initial_peers=None,  # joined by dht_join.join_any once the node runs: all at once, never refused a start
        host_maddrs=[stage_maddr(m, stage) for m in cfg.host_maddrs],
        announce_maddrs=[stage_maddr(m, stage) for m in cfg.announce_maddrs] or None,
        start=True,
        startup_timeout=30,
        record_validators=[validator],
        identity_path=str(identity_path),
        check_if_identity_free=False,  # hivemind's check reads RSA keys only; the key is this worker's own file
        node_id=node_id_of(peer_id_of(worker_identity(identity_path))),
        # every read of the run's records asks for the latest (every node's copy), so hivemind's caching only adds
        # traffic: a found value re-stored on the nearest node that lacked it, a node's cached copy sent in its
        # answers, a cached key read again in the background after each store under it and before it expires
        # (each a whole dictionary: every member's record). 8 tiny peers: 1.4 such reads per member and round.
        cache_locally=False,
        cache_nearest=0,
        cache_on_store=False,
        cache_refresh_before_expiry=0,
    )
    if loopback_only(kwargs["host_maddrs"]):
        # nothing outside this machine can reach it: no UPnP/NAT-PMP port mapping (multicast probes of the LAN)
        # and no AutoNAT service, both idle work in every daemon of a local swarm (tests, demos)
        kwargs.update(nat_port_map=False, auto_nat=False)
    if cfg.auto_relay:  # behind NAT: reserve a slot on the relays among the initial peers (bootstrap --relay)
        kwargs.update(use_auto_relay=True, trusted_relays=list(cfg.initial_peers) or None)
    try:
        dht = HelperDHT(nice=max(cfg.helper_nice, 0), **kwargs)
    except Exception as e:  # hivemind raises P2PDaemonError, ValueError, TimeoutError...
        raise SwarmError(f"could not start the DHT node on {' '.join(cfg.host_maddrs)}: {_first_line(e)}") from None
    # the swarm is reached through an initial peer (the peer's own stage 0 is linked on the way); without any,
    # through `extra_peers` alone
    targets, also = (cfg.initial_peers, extra_peers) if cfg.initial_peers else (tuple(extra_peers), ())
    started = time.monotonic()
    try:
        if targets and not join_any(dht, targets, timeout=join_s, also=also):
            raise SwarmUnreachable(
                f"could not join the swarm through --initial-peers {' '.join(targets)}: none answered "
                f"within {time.monotonic() - started:.0f} s. Check that each address is complete "
                "(/ip4/HOST/tcp/PORT/p2p/PEER_ID), that the peer is running, and that its TCP port is open from this "
                "machine"
            )
    except BaseException:  # or a stop asked for while joining (stage_process: SystemExit)
        shutdown_whole(dht)
        raise
    return dht


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def reachable_maddrs(dht: hivemind.DHT) -> list[str]:
    """This node's full multiaddrs, addresses other machines can reach first (loopback last)."""
    maddrs = [str(m) for m in dht.get_visible_maddrs(latest=True)]
    return sorted(maddrs, key=lambda m: (m.startswith("/ip4/127.") or m.startswith("/ip6/::1"), m))


@dataclass(frozen=True)
class Member:
    peer_id: str
    record: swarm_pb2.MemberRecord
    expiration: float
    peer_key: bytes = b""
    """The peer (cluster) identity key that vouches for this worker (StageCertificate)."""
    sent_at: float = 0.0
    """When its worker signed the record (its clock): of two copies, the later one is the newer (member_push.py)."""


class RunRecords:
    """Typed access to the run's DHT records for one stage: sealed by `signer`, opened by `gate`."""

    def __init__(self, dht: hivemind.DHT, run_id: str, stage: int, faults: FaultCounter, *, signer: Signer, gate: Gate):
        self.dht, self.run_id, self.stage, self.faults = dht, run_id, stage, faults
        self.signer, self.gate = signer, gate
        self.peer_id = dht.peer_id.to_base58()
        assert self.peer_id == signer.worker_id, "the DHT runs under another key than the signer's"
        self.members_key = f"{run_id}:members:s{stage}"
        self._member_expires = 0.0  # DHT time the member record last stored expires (a later one must outlive it)
        self._member_lock = threading.Lock()  # the heartbeat thread and the worker's updates publish one at a time
        # workers whose member records speak another protocol version -> (that version, when they joined, whether
        # they train), read from the unverified record (its schema may differ): said to a joiner, never trusted
        self.foreign: dict[str, tuple[int, float, bool]] = {}
        # worker -> the key of the peer that vouches for it, as its signed records showed (rank)
        self._owners: dict[str, bytes] = {self.peer_id: bytes(signer.certificate.peer_key)}

    def _store(
        self, key: str, message: Any, ttl: float, *, round: int = 0, best_effort: bool = False, expires: float = 0.0
    ) -> bool:
        """Store `message` under `key`, signed for that key, until `ttl` from now (or DHT time `expires`); a failure
        is counted, or only logged if `best_effort`."""
        value = self.signer.seal(message, topic=key, round=round)
        return self.store_sealed(key, value, expires or get_dht_time() + ttl, best_effort=best_effort)

    def store_sealed(self, key: str, value: bytes, expiration: float, *, best_effort: bool = False) -> bool:
        """Store a sealed record (`Signer.seal` for `key`) under this worker's subkey until DHT time `expiration`;
        whether the DHT holds it. A failure is counted as `publishes_failed`, or only logged if `best_effort`."""
        try:
            future = self.dht.store(key, subkey=self.peer_id, value=value, expiration_time=expiration, return_future=True,
                                    beam_size=BEAM_SIZE)  # fmt: skip
            stored = self._result(future, f"storing {key}") or self._holds(key, value, expiration)
            failure = "" if stored else "no DHT node accepted it"
        except Exception as e:
            stored, failure = False, repr(e)
        if failure and best_effort:
            logger.info("could not store %s: %s", key, failure)
        elif failure:
            self.faults.count("publishes_failed", "could not store %s: %s", key, failure)
        return bool(stored)

    def _holds(self, key: str, value: bytes, expiration: float) -> bool:
        """Whether the DHT holds this very record (`value` until `expiration`) under this worker's subkey, asked
        after a store hivemind reported as refused. It reports the answer of the node that answered last, and a
        node that already held the record refuses the copy: hivemind hands its stored records to a node it has
        (re)met (one that answered again after a request to it timed out, on a loaded machine), and where that
        reached a node before the store did, the store read as refused although every node held the record
        ("no DHT node accepted it" for the average record of a 2-peer swarm in CI)."""
        found = self._result(self.dht.get(key, latest=True, return_future=True, beam_size=BEAM_SIZE),
                             f"reading {key} back")  # fmt: skip
        item = found.value.get(self.peer_id) if found is not None and isinstance(found.value, dict) else None
        return item is not None and item.expiration_time == expiration and item.value == value

    def _get(self, key: str, cls: type, *, round: int | None = None) -> dict[str, tuple[Opened, float]]:
        """Verified records under `key` by subkey (signer); raises if the lookup itself fails."""
        found = self._result(self.dht.get(key, latest=True, return_future=True, beam_size=BEAM_SIZE),
                             f"reading {key}")  # fmt: skip
        if found is None or not isinstance(found.value, dict):
            return {}
        out = {}
        for subkey, item in found.value.items():
            try:
                if not isinstance(subkey, str):
                    raise WireRejected(f"subkey {str(subkey)[:30]!r} is not a peer id")
                opened = self.gate.open(getattr(item, "value", None), cls, sender=subkey, topic=key, round=round)
            except ForeignProtocol as e:
                if cls is swarm_pb2.MemberRecord:
                    self.foreign[str(subkey)] = (e.version, *_claimed_membership(item.value))
                self.faults.count("records_refused", "refused a record under %s: %s", key, e)
                continue
            except WireRejected as e:
                self.faults.count("records_refused", "refused a record under %s: %s", key, e)
                continue
            if isinstance(opened.message, swarm_pb2.AverageRecord):  # fields used as they are: checked here
                spans = [(m.start, m.end) for m in opened.message.missing]
                if (why := malformed_average(opened.message.kind, spans)) is not None:
                    self.faults.count("records_refused", "refused %s's record under %s: %s", subkey, key, why)
                    continue
            out[subkey] = (opened, item.expiration_time)
            self._owners[subkey] = bytes(opened.peer_key)
        return out

    def key_of(self, worker_id: str) -> bytes | None:
        """The peer key that certifies `worker_id`, as its signed records showed (None: none read yet)."""
        return self._owners.get(worker_id)

    def rank(self, worker_id: str) -> tuple[bytes, str]:
        """Who wins a tie between hashes (agreement.majority_hash): the worker whose peer key is smallest, then
        the smallest worker id. One peer's workers rank alike in every stage, so a peer wins or loses a tie in
        all its stages at once. A worker none of whose records were read yet ranks after the known ones."""
        return self._owners.get(worker_id, b"\xff" * 33), worker_id

    def _result(self, future: Any, what: str) -> Any:
        return dht_result(self.dht, future, what)

    def publish_member(
        self, record: swarm_pb2.MemberRecord, ttl: float = MEMBER_TTL_S, *, leaving: bool = False
    ) -> tuple[bytes, float]:
        """Publish this worker's member record; `leaving`: the last one, best effort (it expires anyway). Returns
        the sealed record and its DHT expiration (what a push to the other members sends: member_push.py).

        A DHT node keeps a subkey's value with the latest expiration, so the last record expires just after
        the one before it, not `ttl` from now: a record that expired sooner was refused by every node, and the
        others took a worker that had left for a training member until its last heartbeat expired (dialing
        it in vain for seconds when they borrowed an average). Publishes never overlap, and each expires after
        the one before: the heartbeat thread's record and a worker's update, stored at once, could reach the
        nodes in the other order, and the one that expired sooner was refused ("no DHT node accepted it", a
        publish counted as failed: fresh-clone CI of 21e8edf)."""
        with self._member_lock:
            expires = max(get_dht_time() + ttl, self._member_expires + 0.001)
            if not leaving:
                self._member_expires = expires  # also if only some nodes took it
            value = self.seal_member(record)
            self.store_sealed(self.members_key, value, expires, best_effort=leaving)
            return value, expires

    def seal_member(self, record: swarm_pb2.MemberRecord) -> bytes:
        """This worker's member record sealed as publish_member stores it: what a push to the others sends."""
        return self.signer.seal(record, topic=self.members_key)

    def members(self) -> list[Member]:
        found = self._get(self.members_key, swarm_pb2.MemberRecord).items()
        return [m for peer_id, (opened, exp) in found if (m := self._member(peer_id, opened, exp)) is not None]

    def open_member(self, sender: str, value: bytes, expiration: float) -> Member | None:
        """A member record `sender` pushed (member_push.py), checked as one read from the DHT; None if refused
        (counted as a refused request: a push is one) or expired. Its expiration is capped at a fresh record's: the
        push carries it unsigned."""
        try:
            opened = self.gate.open(value, swarm_pb2.MemberRecord, sender=sender, topic=self.members_key)
        except WireRejected as e:
            self.faults.count("requests_refused", "refused a member record %s pushed: %s", sender, e)
            return None
        self._owners[sender] = bytes(opened.peer_key)
        return self._member(sender, opened, min(expiration, get_dht_time() + MEMBER_TTL_S))

    def _member(self, peer_id: str, opened: Opened, expiration: float) -> Member | None:
        """The member `opened` describes if it is of this run and stage and live; None (counted if foreign)."""
        record = opened.message
        if record.run_id != self.run_id or record.stage != self.stage or opened.envelope.sender.stage != self.stage:
            self.faults.count(
                "records_refused", "refused the member record of %s: run %r stage %d under this run's key",
                peer_id, record.run_id, record.stage,
            )
            return None
        if not JOINED_FLOOR <= record.joined_at <= opened.envelope.sent_at + EXPIRY_SLACK_S:
            self.faults.count("records_refused", "refused the member record of %s: it joined at %r, not between %d "
                              "and when it signed the record (%.0f)", peer_id, record.joined_at, JOINED_FLOOR,
                              opened.envelope.sent_at)  # fmt: skip
            return None
        if expiration <= get_dht_time():
            return None
        return Member(peer_id, record, expiration, opened.peer_key, opened.envelope.sent_at)

    def publish_round(self, record: swarm_pb2.RoundRecord) -> bool:
        key = f"{self.run_id}:round:s{self.stage}:{record.boundary}"
        return self._store(key, record, ROUND_RECORD_TTL_S, round=record.boundary)

    def round_records(self, boundary: int) -> dict[str, swarm_pb2.RoundRecord]:
        records = self._get(f"{self.run_id}:round:s{self.stage}:{boundary}", swarm_pb2.RoundRecord, round=boundary)
        return {peer: o.message for peer, (o, _) in records.items() if o.message.boundary == boundary}

    def _average_key(self, round: int) -> str:
        return f"{self.run_id}:average:s{self.stage}:{round}"

    def seal_average(self, record: swarm_pb2.AverageRecord) -> bytes:
        """`record` sealed as `publish_average` stores it: what a push to the group's other voters sends."""
        return self.signer.seal(record, topic=self._average_key(record.round), round=record.round)

    def publish_average(self, record: swarm_pb2.AverageRecord, sealed: bytes | None = None) -> bool:
        """Store this worker's AverageRecord (`sealed`: as `seal_average` sealed it, pushed already)."""
        if sealed is None:
            return self._store(self._average_key(record.round), record, AVERAGE_RECORD_TTL_S, round=record.round)
        return self.store_sealed(self._average_key(record.round), sealed, get_dht_time() + AVERAGE_RECORD_TTL_S)

    def average_records(self, round: int) -> dict[str, swarm_pb2.AverageRecord]:
        return {peer: o.message for peer, o in self.opened_averages(round).items()}

    def opened_averages(self, round: int) -> dict[str, Opened]:
        """The AverageRecords of round `round` in the DHT, opened (their envelopes say when each was signed)."""
        records = self._get(self._average_key(round), swarm_pb2.AverageRecord, round=round)
        return {peer: o for peer, (o, _) in records.items() if o.message.round == round}

    def open_average(self, sender: str, value: bytes, round: int) -> Opened | None:
        """An AverageRecord of round `round` that `sender` pushed (member_push.py), checked as one read from the DHT;
        None if refused (counted as a refused request)."""
        try:
            opened = self.gate.open(value, swarm_pb2.AverageRecord, sender=sender, topic=self._average_key(round),
                                    round=round)  # fmt: skip
        except WireRejected as e:
            self.faults.count("requests_refused", "refused an average record %s pushed: %s", sender, e)
            return None
        record = opened.message
        why = malformed_average(record.kind, [(m.start, m.end) for m in record.missing])
        if why is None and record.round != round:
            why = f"it is of round {record.round} under round {round}'s key"
        if why is not None:
            self.faults.count("requests_refused", "refused an average record %s pushed: %s", sender, why)
            return None
        return opened

    def publish_config(self, config_hash: str, shared_json: str) -> None:
        record = swarm_pb2.ConfigRecord(config_hash=config_hash, shared_json=shared_json)
        self._store(f"{self.run_id}:config:{config_hash}", record, ROUND_RECORD_TTL_S)

    def publish_digests(self, record: swarm_pb2.DigestRecord) -> bool:
        key = f"{self.run_id}:digests:s{self.stage}:{record.round}:{self.peer_id}"
        return self._store(key, record, AVERAGE_RECORD_TTL_S, round=record.round)

    def digest_records(self, round: int, workers: Iterable[str]) -> dict[str, swarm_pb2.DigestRecord]:
        """The DigestRecords of round `round` that `workers` published (those found), one lookup each."""
        found = {}
        for worker in workers:
            records = self._get(f"{self.run_id}:digests:s{self.stage}:{round}:{worker}", swarm_pb2.DigestRecord,
                                round=round)  # fmt: skip
            if worker in records and records[worker][0].message.round == round:
                found[worker] = records[worker][0].message
        return found

    def config(self, config_hash: str) -> str | None:
        for opened, _ in self._get(f"{self.run_id}:config:{config_hash}", swarm_pb2.ConfigRecord).values():
            if opened.message.config_hash == config_hash:
                return opened.message.shared_json
        return None


def _claimed_membership(blob: bytes) -> tuple[float, bool]:
    """(joined_at, training) as a foreign member record claims them; (inf, False) if unreadable."""
    try:
        body = envelope_pb2.Envelope.FromString(envelope_pb2.SignedEnvelope.FromString(blob).body)
        record = swarm_pb2.MemberRecord.FromString(body.payload)
        return record.joined_at, record.training
    except Exception:
        return float("inf"), False
