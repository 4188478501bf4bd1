"""The control plane of a peer: what its lead stage (0) tells operators while it trains.

    board = StatusBoard(run_id=..., mode=..., ...)       # the one picture of the peer
    plane = ControlPlane.start(cfg, board, run_dir)      # gRPC PeerControl + health, Prometheus
    board.set_state("training"); board.step(round, step); board.round_done(record)
    plane.close("finished")

- gRPC `PeerControl` (proto/dilocox/v1/control.proto): `GetStatus` (a PeerStatus snapshot) and
  `Watch` (a stream of RoundEvents: every completed round's metrics record, every change of
  state), with the standard grpc.health.v1 service, on `control.control_addr` (default
  127.0.0.1, a free port); the bound address goes to RUN_DIR/control.addr for
  `dilocox-peer status RUN_DIR`. Read-only. Requests from this machine are served as they come; from
  other hosts only those signed by an operator key listed in `control.operator_keys` (control_auth.py;
  refusals counted as the fault `control_refused`). At most MAX_WATCHERS Watch streams at once, so that
  GetStatus and health always have server threads.
- Prometheus text format at http://`control.metrics_addr`/metrics (when set, its own address), collected
  from the same snapshot at scrape time, so /metrics and `status` never disagree. Unauthenticated.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from . import __version__
from .config import Config
from .control_auth import ControlGate, ControlInterceptor, operator_keys_from_hex
from .endpoints import GrpcEndpoint, parse_hostport, start_metrics_http, write_atomically
from .proto_gen import control_pb2, control_pb2_grpc

__all__ = ["ControlPlane", "StatusBoard", "compression_ratio"]

logger = logging.getLogger(__name__)

RECENT_ROUNDS = 16
STATES = ("starting", "joining", "training", "finished", "stopped", "failed")
_WATCH_QUEUE = 256
GRPC_THREADS = 8
MAX_WATCHERS = GRPC_THREADS // 2
"""Watch streams served at once: each holds a server thread while it is open, and GetStatus and health need the
others (8 idle streams starved them, issue 38 point 5); one more is refused with RESOURCE_EXHAUSTED."""


def compression_ratio(record: dict[str, Any]) -> float:
    """How many times fewer bytes this peer sent in the round than an fp32 butterfly all-reduce of the same
    pseudo-gradients in the same groups would (2 (n-1)/n of the fp32 bytes per stage); 0 when nothing was sent."""
    ideal = 0.0
    for fp32, n in zip(record.get("fp32_bytes") or [], record.get("group_sizes") or []):
        if fp32 and n and n > 1:
            ideal += fp32 * 2 * (n - 1) / n
    sent = record.get("bytes_sent") or 0
    return ideal / sent if sent and ideal else 0.0


class StatusBoard:
    """The peer's status, written by the lead stage's round loop, read by the gRPC and HTTP threads."""

    def __init__(self, cfg: Config, *, rounds: int, steps: int):
        self._lock = threading.Lock()
        self._watchers: list[queue.Queue[control_pb2.RoundEvent | None]] = []
        self._last_round: control_pb2.RoundEvent | None = None
        self.status = control_pb2.PeerStatus(
            run_id=cfg.run.run_id, version=__version__, state="starting", mode=cfg.outer.mode,
            compression=cfg.compression.kind, stages=cfg.model.stages, rounds=rounds, steps_per_round=steps,
            train_loss=math.nan, val_loss=math.nan, started_at=time.time(), updated_at=time.time(),
        )  # fmt: skip

    # ----- writers (the round loop) ----------------------------------------------------------
    def identify(self, *, peer_id: str = "", peer_key: str = "", multiaddrs: list[str] | None = None) -> None:
        with self._lock:
            self.status.peer_id, self.status.peer_key = peer_id, peer_key
            self.status.multiaddrs[:] = multiaddrs or []

    def set_state(self, state: str) -> None:
        assert state in STATES, state
        with self._lock:
            if self.status.state == state:
                return
            self.status.state = state
            self.status.updated_at = time.time()
            event = control_pb2.RoundEvent(event="state", round=self.status.round, state=state, time=time.time())
        logger.info("peer state: %s", state)
        self._publish(event)

    def step(self, round: int, step: int) -> None:
        with self._lock:
            self.status.round, self.status.step = round, step

    def round_done(self, record: dict[str, Any], *, members: list[list[str]] | None = None) -> None:
        """A completed round's metrics.jsonl record (worker.py) and each stage's live members."""
        with self._lock:
            s = self.status
            s.round, s.step, s.updated_at = record["round"] + 1, 0, time.time()
            s.last_round_at = s.updated_at
            s.train_loss = math.nan if record["train_loss"] is None else record["train_loss"]
            s.val_loss = record["val_loss"]
            s.tokens, s.tokens_per_s = record["tokens"], record["tokens_per_s"]
            s.bytes_sent += record["bytes_sent"]
            s.bytes_received += record["bytes_received"]
            ratio = compression_ratio(record)
            s.compression_ratio = ratio or s.compression_ratio
            s.seconds_comm_wait = record["seconds_comm_wait"]
            s.stage_hashes[:] = record["stage_hashes"]
            del s.stage_status[:]
            members = members or [[] for _ in record["stage_hashes"]]
            clients = record.get("clients") or ["" for _ in record["stage_hashes"]]
            shares = record.get("counted_shares") or [None for _ in record["stage_hashes"]]
            for stage, (state_hash, size, kind, names, client, share) in enumerate(
                zip(record["stage_hashes"], record["group_sizes"], record["kinds"], members, clients, shares)
            ):
                s.stage_status.add(stage=stage, state_hash=state_hash, group_size=size or 0, kind=kind or "",
                                   group_members=names, client=client, counted_share=share)  # fmt: skip
            s.recent_rounds.add(
                round=record["round"], stage_hashes=record["stage_hashes"], group_size=record.get("group_size") or 0,
                val_loss=record["val_loss"],
            )  # fmt: skip
            del s.recent_rounds[:-RECENT_ROUNDS]
            for name, count in (record.get("faults") or {}).items():
                s.faults[name] = s.faults[name] + count
            event = control_pb2.RoundEvent(
                event="round", round=record["round"], state=s.state, time=time.time(), record_json=json.dumps(record)
            )
            self._last_round = event
        self._publish(event)

    def count(self, fault: str) -> None:
        """One more of `fault` (a refused control request), beside the rounds' counts."""
        with self._lock:
            self.status.faults[fault] = self.status.faults[fault] + 1
            self.status.updated_at = time.time()

    # ----- readers -----------------------------------------------------------------------------
    def snapshot(self) -> control_pb2.PeerStatus:
        with self._lock:
            out = control_pb2.PeerStatus()
            out.CopyFrom(self.status)
            return out

    def subscribe(
        self, *, include_current: bool, limit: int | None = None
    ) -> queue.Queue[control_pb2.RoundEvent | None] | None:
        """A queue of this board's events from now on (None: `limit` watchers are subscribed already)."""
        q: queue.Queue[control_pb2.RoundEvent | None] = queue.Queue(maxsize=_WATCH_QUEUE)
        with self._lock:
            if limit is not None and len(self._watchers) >= limit:
                return None
            if include_current and self._last_round is not None:
                q.put_nowait(self._last_round)
            self._watchers.append(q)
        return q

    def unsubscribe(self, q: queue.Queue[control_pb2.RoundEvent | None]) -> None:
        with self._lock:
            if q in self._watchers:
                self._watchers.remove(q)

    def close_watchers(self) -> None:
        with self._lock:
            watchers, self._watchers = self._watchers, []
        for q in watchers:
            _put_dropping_oldest(q, None)

    def _publish(self, event: control_pb2.RoundEvent) -> None:
        with self._lock:
            watchers = list(self._watchers)
        for q in watchers:  # a watcher that does not read loses its oldest events, never blocks training
            _put_dropping_oldest(q, event)


def _put_dropping_oldest(q: queue.Queue[Any], item: Any) -> None:
    while True:
        try:
            q.put_nowait(item)
            return
        except queue.Full:
            try:
                q.get_nowait()
            except queue.Empty:
                pass


class PeerControlService(control_pb2_grpc.PeerControlServicer):
    def __init__(self, board: StatusBoard, stopping: threading.Event):
        self.board, self.stopping = board, stopping

    def GetStatus(self, request: control_pb2.StatusRequest, context: Any) -> control_pb2.PeerStatus:
        return self.board.snapshot()

    def Watch(self, request: control_pb2.WatchRequest, context: Any) -> Iterator[control_pb2.RoundEvent]:
        q = self.board.subscribe(include_current=request.include_current, limit=MAX_WATCHERS)
        if q is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{MAX_WATCHERS} Watch streams are open on this peer already, the most it serves beside "
                          "GetStatus and health: close one, or poll GetStatus")  # fmt: skip
        try:
            while context.is_active() and not self.stopping.is_set():
                try:
                    event = q.get(timeout=0.5)
                except queue.Empty:
                    continue
                if event is None:
                    return
                yield event
        finally:
            self.board.unsubscribe(q)


class StatusCollector:
    """Prometheus figures read from the board's snapshot at scrape time."""

    def __init__(self, board: StatusBoard):
        self.board = board

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, StateSetMetricFamily

        s = self.board.snapshot()
        yield InfoMetricFamily(
            "dilocox_peer", "who this peer is",
            value={"run_id": s.run_id, "peer_id": s.peer_id, "version": s.version, "mode": s.mode,
                   "compression": s.compression},
        )  # fmt: skip
        yield StateSetMetricFamily("dilocox_state", "the peer's state", value={name: name == s.state for name in STATES})
        gauges = {
            "dilocox_round": ("rounds completed (sync rounds in streaming mode)", s.round),
            "dilocox_rounds": ("rounds the run lasts", s.rounds),
            "dilocox_inner_step": ("inner steps done in the round in flight", s.step),
            "dilocox_train_loss": ("mean training loss of the last round", s.train_loss),
            "dilocox_val_loss": ("validation loss of theta_g after the last round", s.val_loss),
            "dilocox_tokens_per_second": ("tokens per second of the last round", s.tokens_per_s),
            "dilocox_compression_ratio": ("fp32 butterfly bytes / bytes sent, last round that sent", s.compression_ratio),
            "dilocox_comm_wait_seconds": ("seconds training waited for communication, last round", s.seconds_comm_wait),
            "dilocox_stages": ("pipeline stages of this peer", s.stages),
            "dilocox_start_time_seconds": ("unix time the peer started", s.started_at),
            "dilocox_last_round_time_seconds": ("unix time the last round completed (0: none yet)", s.last_round_at),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        group = GaugeMetricFamily("dilocox_group_size", "peers in the stage's last all-reduce", labels=["stage"])
        client = GaugeMetricFamily("dilocox_client_member", "1 where the stage averages as a client member (the swarm "
                                   "cannot dial it: it reduces nothing, leads no group)", labels=["stage"])  # fmt: skip
        counted = GaugeMetricFamily("dilocox_counted_share", "share of the stage's last compressed message the applied "
                                    "average counted (the rest waits in its error-feedback buffer)", labels=["stage"])  # fmt: skip
        for st in s.stage_status:
            group.add_metric([str(st.stage)], st.group_size)
            client.add_metric([str(st.stage)], 1 if st.client else 0)
            if st.HasField("counted_share"):
                counted.add_metric([str(st.stage)], st.counted_share)
        yield group
        yield client
        yield counted
        yield CounterMetricFamily("dilocox_tokens", "tokens trained by this peer", value=s.tokens)
        yield CounterMetricFamily("dilocox_bytes_sent", "bytes this peer sent averaging, since it started", value=s.bytes_sent)
        yield CounterMetricFamily(
            "dilocox_bytes_received", "bytes this peer received averaging, since it started", value=s.bytes_received
        )
        faults = CounterMetricFamily("dilocox_faults", "faults counted since start", labels=["kind"])
        for kind, count in sorted(s.faults.items()):
            faults.add_metric([kind], count)
        yield faults


class ControlPlane:
    """The gRPC and HTTP servers of the lead stage; `close` marks the final state and stops them."""

    def __init__(self, board: StatusBoard, grpc_endpoint: GrpcEndpoint, addr_file: Path, http: Any, stopping: threading.Event):
        self.board, self.grpc, self.addr_file, self.http = board, grpc_endpoint, addr_file, http
        self.stopping = stopping  # ends the Watch streams

    @classmethod
    def start(cls, cfg: Config, board: StatusBoard, run_dir: Path) -> ControlPlane:
        stopping = threading.Event()
        service = PeerControlService(board, stopping)
        keys = operator_keys_from_hex(cfg.control.operator_keys, flag="control.operator_keys")
        interceptor = ControlInterceptor(ControlGate(keys), _Refusals(board).record)
        endpoint = GrpcEndpoint.start(
            cfg.control.control_addr, flag="--control-addr", workers=GRPC_THREADS, interceptors=[interceptor],
            add=lambda server: control_pb2_grpc.add_PeerControlServicer_to_server(service, server),
        )  # fmt: skip
        if not _is_local(endpoint.address, "--control-addr"):
            if keys:
                logger.info("--control-addr %s: requests from other hosts are served when signed by one of %d operator "
                            "key(s) (control.operator_keys)", endpoint.address, len(keys))  # fmt: skip
            else:
                logger.warning("--control-addr %s listens beyond this machine, but no control.operator_keys are listed: "
                               "requests from other hosts are refused. List an operator's key (`dilocox-peer keygen`, "
                               "then --operator-keys HEX) to read this peer from another host", endpoint.address)  # fmt: skip
        http = None
        if cfg.control.metrics_addr:
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry()
            registry.register(StatusCollector(board))
            try:
                http, metrics_at = start_metrics_http(cfg.control.metrics_addr, registry)
            except Exception:
                endpoint.stop(0)
                raise
            logger.info("Prometheus metrics at http://%s/metrics", metrics_at)
            _warn_if_reachable(metrics_at, "--metrics-addr", "its metrics")
        addr_file = Path(run_dir) / "control.addr"
        write_atomically(addr_file, endpoint.address + "\n")
        logger.info("control plane at %s (dilocox-peer status %s)", endpoint.address, run_dir)
        return cls(board, endpoint, addr_file, http, stopping)

    def close(self, state: str) -> None:
        self.board.set_state(state)
        self.stopping.set()
        self.board.close_watchers()
        self.addr_file.unlink(missing_ok=True)
        if self.http is not None:
            self.http.shutdown()
        self.grpc.stop(grace=1.0)


class _Refusals:
    """Counts refused control requests on the board and logs them, at most one line per LOG_EVERY_S."""

    LOG_EVERY_S = 10.0

    def __init__(self, board: StatusBoard):
        self.board, self._logged_at, self._since = board, -math.inf, 0
        self._lock = threading.Lock()

    def record(self, reason: str, peer: str) -> None:
        self.board.count("control_refused")
        with self._lock:
            self._since += 1
            if time.monotonic() - self._logged_at < self.LOG_EVERY_S:
                return
            count, self._since, self._logged_at = self._since, 0, time.monotonic()
        logger.warning("refused %d control request(s), the last from %s: %s", count, peer, reason)


def _is_local(address: str, flag: str) -> bool:
    host, _ = parse_hostport(address, flag=flag)
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: where it points is not known here
        return False


def _warn_if_reachable(address: str, flag: str, what: str) -> None:
    """Say so when an unauthenticated endpoint (/metrics) listens beyond this machine (any address not on loopback)."""
    if not _is_local(address, flag):
        logger.warning(
            "%s %s listens beyond this machine with no authentication: anyone who reaches it reads %s. Keep it "
            "on loopback (the default), or on a trusted network behind a firewall", flag, address, what,
        )  # fmt: skip
