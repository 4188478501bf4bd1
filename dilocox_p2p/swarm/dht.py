"""The DHT side of a stage worker: start the node, and read/write the run's records.

Keys (values are protobuf bytes from proto/dilocox/v1/swarm.proto, subkey = peer id):
    {run}:members:s{stage}        MemberRecord per live worker, refreshed by a heartbeat
    {run}:round:s{stage}:{b}      RoundRecord: the state (and pending average) hashes each worker holds at b
    {run}:config:{hash}           ConfigRecord: the shared config behind a hash

A lookup that fails raises (the caller counts it); a record that cannot be decoded or
belongs to another run or stage is skipped and counted as `records_refused`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from ..config import SwarmConfig
from ..errors import SwarmError, WireRejected
from ..wire import decode, encode, swarm_pb2
from .faults import FaultCounter
from .priority import lower_priority

__all__ = ["Heartbeat", "RunRecords", "start_dht"]

logger = logging.getLogger(__name__)

MEMBER_TTL_S = 15.0
HEARTBEAT_S = 5.0
ROUND_RECORD_TTL_S = 600.0


def stage_maddr(maddr: str, stage: int) -> str:
    """Stage s listens on PORT + s when a fixed TCP port is given (port 0 stays random)."""
    parts = maddr.split("/")
    for i in range(len(parts) - 1):
        if parts[i] in ("tcp", "udp") and parts[i + 1].isdigit() and int(parts[i + 1]) != 0:
            parts[i + 1] = str(int(parts[i + 1]) + stage)
    return "/".join(parts)


class HelperDHT(hivemind.DHT):
    """hivemind's DHT process (and the p2p daemon it starts), run `nice` levels below training."""

    def __init__(self, *, nice: int, **kwargs: Any):
        self.nice = nice
        super().__init__(**kwargs)

    def run(self) -> None:
        lower_priority(self.nice)
        super().run()


def start_dht(
    cfg: SwarmConfig, *, stage: int, identity_path: Path | None, extra_peers: Sequence[str] = ()
) -> hivemind.DHT:
    """Start this worker's DHT node and join the swarm; errors name the failing address.

    `extra_peers` are this peer's own stage-0 node, so that a peer's stages share one DHT.
    """
    kwargs: dict[str, Any] = dict(
        initial_peers=[*cfg.initial_peers, *extra_peers] or None,
        host_maddrs=[stage_maddr(m, stage) for m in cfg.host_maddrs],
        announce_maddrs=[stage_maddr(m, stage) for m in cfg.announce_maddrs] or None,
        start=True,
        startup_timeout=30,
    )
    if identity_path is not None:
        identity_path.parent.mkdir(parents=True, exist_ok=True)
        kwargs["identity_path"] = str(identity_path)
    try:
        return HelperDHT(nice=max(cfg.helper_nice, 0), **kwargs)
    except Exception as e:  # hivemind raises P2PDaemonError, ValueError, TimeoutError...
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if cfg.initial_peers:
            raise SwarmError(
                f"could not join the swarm through --initial-peers {' '.join(cfg.initial_peers)}: {text}. "
                "Check that each address is complete (/ip4/HOST/tcp/PORT/p2p/PEER_ID), that the peer is running, "
                "and that its TCP port is open from this machine"
            ) from None
        raise SwarmError(f"could not start the DHT node on {' '.join(cfg.host_maddrs)}: {text}") from None


def reachable_maddrs(dht: hivemind.DHT) -> list[str]:
    """This node's full multiaddrs, addresses other machines can reach first (loopback last)."""
    maddrs = [str(m) for m in dht.get_visible_maddrs(latest=True)]
    return sorted(maddrs, key=lambda m: (m.startswith("/ip4/127.") or m.startswith("/ip6/::1"), m))


@dataclass(frozen=True)
class Member:
    peer_id: str
    record: swarm_pb2.MemberRecord
    expiration: float


class RunRecords:
    """Typed access to the run's DHT records for one stage."""

    def __init__(self, dht: hivemind.DHT, run_id: str, stage: int, faults: FaultCounter):
        self.dht, self.run_id, self.stage, self.faults = dht, run_id, stage, faults
        self.peer_id = dht.peer_id.to_base58()
        self.members_key = f"{run_id}:members:s{stage}"

    def _store(self, key: str, message: Any, ttl: float, *, best_effort: bool = False) -> bool:
        """Store `message` under `key`; a failure is counted, or only logged if `best_effort`."""
        try:
            stored = self.dht.store(key, subkey=self.peer_id, value=encode(message), expiration_time=get_dht_time() + ttl)
            failure = "" if stored else "no DHT node accepted it"
        except Exception as e:
            stored, failure = False, repr(e)
        if failure and best_effort:
            logger.info("could not store %s: %s", key, failure)
        elif failure:
            self.faults.count("publishes_failed", "could not store %s: %s", key, failure)
        return bool(stored)

    def _get(self, key: str, cls: type) -> dict[str, tuple[Any, float]]:
        """Decoded records under `key` by subkey; raises if the lookup itself fails."""
        found = self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        out = {}
        for subkey, item in found.value.items():
            try:
                message = decode(cls, getattr(item, "value", None))
            except WireRejected as e:
                self.faults.count("records_refused", "refused a record under %s from %s: %s", key, subkey, e)
                continue
            if isinstance(subkey, str):
                out[subkey] = (message, item.expiration_time)
        return out

    def publish_member(self, record: swarm_pb2.MemberRecord, ttl: float = MEMBER_TTL_S, *, leaving: bool = False) -> bool:
        """Publish this worker's member record; `leaving`: the last one, best effort (it expires anyway)."""
        return self._store(self.members_key, record, ttl, best_effort=leaving)

    def members(self) -> list[Member]:
        now = get_dht_time()
        members = []
        for peer_id, (record, exp) in self._get(self.members_key, swarm_pb2.MemberRecord).items():
            if record.run_id != self.run_id or record.stage != self.stage:
                self.faults.count(
                    "records_refused", "refused the member record of %s: run %r stage %d under this run's key",
                    peer_id, record.run_id, record.stage,
                )
            elif exp > now:
                members.append(Member(peer_id, record, exp))
        return members

    def publish_round(self, record: swarm_pb2.RoundRecord) -> bool:
        return self._store(f"{self.run_id}:round:s{self.stage}:{record.boundary}", record, ROUND_RECORD_TTL_S)

    def round_records(self, boundary: int) -> dict[str, swarm_pb2.RoundRecord]:
        records = self._get(f"{self.run_id}:round:s{self.stage}:{boundary}", swarm_pb2.RoundRecord)
        return {peer: r for peer, (r, _) in records.items() if r.boundary == boundary}

    def publish_config(self, config_hash: str, shared_json: str) -> None:
        record = swarm_pb2.ConfigRecord(config_hash=config_hash, shared_json=shared_json)
        self._store(f"{self.run_id}:config:{config_hash}", record, ROUND_RECORD_TTL_S)

    def config(self, config_hash: str) -> str | None:
        for record, _ in self._get(f"{self.run_id}:config:{config_hash}", swarm_pb2.ConfigRecord).values():
            if record.config_hash == config_hash:
                return record.shared_json
        return None


class Heartbeat:
    """Re-publishes this worker's MemberRecord every HEARTBEAT_S seconds in a thread."""

    def __init__(self, records: RunRecords, record: swarm_pb2.MemberRecord):
        self.records = records
        self._record = record
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._now = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def update(self, *, wait: bool = True, **fields: Any) -> None:
        """Change fields of the record and publish it (in the heartbeat thread unless `wait`)."""
        with self._lock:
            for name, value in fields.items():
                setattr(self._record, name, value)
        if wait:
            self.beat()
        else:
            self._now.set()

    def beat(self) -> None:
        with self._lock:
            record = swarm_pb2.MemberRecord()
            record.CopyFrom(self._record)
        self.records.publish_member(record)  # a failure is counted there

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._now.wait(HEARTBEAT_S)
            self._now.clear()
            if not self._stop.is_set():
                self.beat()

    def stop(self, *, leave: bool = True) -> None:
        """Stop beating; with `leave`, tell the others this worker no longer trains."""
        self._stop.set()
        self._now.set()
        self._thread.join(timeout=5)
        if leave:
            with self._lock:
                self._record.training = False
                self._record.state_ready = False
            self.records.publish_member(self._record, ttl=1.0, leaving=True)
