"""A bootstrap node: the long-lived DHT node a swarm's peers pass to --initial-peers.

    node = BootstrapNode.start(BootstrapOptions(state_dir=Path("bootstrap-state")))
    node.maddrs                    # what peers pass to --initial-peers (also STATE_DIR/multiaddrs.txt)
    code = node.serve(stop_event)  # until stop_event is set (SIGTERM) or the DHT process dies
    node.stop()

It is run-agnostic: it holds no validators, so it stores and serves the records of any run
(each dilocox peer validates what it reads), and answers Hello with role "bootstrap". Its
libp2p identity is an Ed25519 key kept in the state directory (mode 0600), and it listens on
a fixed port by default, so its multiaddr is the same after every restart.

Health: STATE_DIR/health.addr names a gRPC endpoint serving the standard grpc.health.v1
service: SERVING while the DHT node answers, NOT_SERVING otherwise. Optional Prometheus
metrics: dilocox_bootstrap_up, _routing_table_peers, _stored_records, _uptime_seconds.

Relay: hivemind 1.1.12's p2p daemon runs a circuit-relay v2 service whenever relaying is on
(hivemind's default); `relay=True` also declares the node publicly reachable, so that it
never waits for AutoNAT before serving peers started with --auto-relay.
"""

from __future__ import annotations

import functools
import logging
import secrets
import signal
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hivemind
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.node import DHTNode
from multiaddr import Multiaddr

from .doctor import listen_hostport, parse_peer_maddr
from .endpoints import GrpcEndpoint, ensure_port_free, parse_hostport, start_metrics_http, write_atomically
from .errors import ConfigError, IdentityError, SwarmError
from .identity import peer_id_of, worker_identity
from .logs import route_hivemind_logs, set_log_context
from .swarm.daemon_gc import tune_daemon_gc
from .swarm.dht import node_id_of, reachable_maddrs
from .swarm.dht_join import ping_missing
from .swarm.hello import serve_hello
from .swarm.hivemind_patches import patch_for_dht_node

__all__ = ["BootstrapNode", "BootstrapOptions", "load_node_identity"]

logger = logging.getLogger(__name__)

STATUS_PERIOD_S = 10.0
"""How often the node is asked for its routing table (which also refreshes it) and health is updated."""
STATUS_TIMEOUT_S = 15.0


@dataclass(frozen=True, kw_only=True, slots=True)
class BootstrapOptions:
    state_dir: Path = Path("bootstrap-state")
    """Holds identity.key, multiaddrs.txt and health.addr."""
    identity: Path | None = None
    """The libp2p key file; None: STATE_DIR/identity.key, created (0600) on first start."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/31337",)
    """Where the node listens; a fixed port keeps its multiaddr stable across restarts."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses peers should dial (public IP, NAT mapping); empty: the listen addresses."""
    initial_peers: tuple[str, ...] = ()
    """Other bootstrap nodes of the same swarm."""
    relay: bool = False
    """Serve as a circuit relay for peers behind NAT (peers pass --auto-relay)."""
    health_addr: str = "127.0.0.1:0"
    """HOST:PORT of the grpc.health.v1 endpoint; port 0 picks one (written to STATE_DIR/health.addr)."""
    metrics_addr: str = ""
    """HOST:PORT for Prometheus /metrics; empty: not served."""
    status_period: float = STATUS_PERIOD_S
    """Seconds between status checks of the node (health, metrics, routing-table refresh)."""

    @property
    def identity_path(self) -> Path:
        return self.identity or self.state_dir / "identity.key"


def load_node_identity(path: Path) -> Ed25519PrivateKey:
    """The node's libp2p key (p2pd format): created 0600 on first start, refused if others can read it."""
    try:
        mode = path.stat().st_mode if path.exists() else None
        if mode is not None and not stat.S_ISREG(mode):
            raise IdentityError(f"identity {path} is not a file: pass --identity FILE (a key file)")
        if mode is not None and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(f"identity {path} is readable by others (mode {stat.S_IMODE(mode):04o}): a copied key "
                                f"is a stolen identity. Fix it with `chmod 600 {path}`")  # fmt: skip
        return _worker_identity(path)
    except OSError as e:
        raise IdentityError(f"identity {path} cannot be read or created ({e.strerror or e}); check the path and "
                            "its directory's permissions") from None  # fmt: skip


def _worker_identity(path: Path) -> Ed25519PrivateKey:
    try:
        return worker_identity(path)
    except IdentityError as e:  # unreadable or not Ed25519
        raise IdentityError(f"{e} (or restore it from a backup: a new key is a new peer id, so peers need the new "
                            "multiaddr)") from None  # fmt: skip


def _check_flags(opts: BootstrapOptions) -> None:
    """Malformed multiaddrs and busy ports, before anything starts (each a ConfigError naming the fix)."""
    for flag, maddrs, complete in (("--host-maddrs", opts.host_maddrs, False),
                                   ("--announce-maddrs", opts.announce_maddrs, False),
                                   ("--initial-peers", opts.initial_peers, True)):  # fmt: skip
        for text in maddrs:
            try:
                parse_peer_maddr(text) if complete else listen_hostport(text)
            except Exception as e:
                example = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..." if complete else "/ip4/0.0.0.0/tcp/31337"
                raise ConfigError(f"{flag} {text!r}: {e}; expected e.g. {example}") from None
    if not opts.host_maddrs:
        raise ConfigError("--host-maddrs: give at least one listen address, e.g. /ip4/0.0.0.0/tcp/31337")
    for text in opts.announce_maddrs:
        if "/tcp/0/" in f"{text}/":
            raise ConfigError(f"--announce-maddrs {text!r}: port 0 cannot be dialed; announce the fixed port of "
                              "--host-maddrs, e.g. /ip4/203.0.113.7/tcp/31337")  # fmt: skip
    for text in opts.host_maddrs:
        hostport = listen_hostport(text)
        if hostport is not None:
            ensure_port_free(*hostport, flag="--host-maddrs")
    for flag, addr in (("--health-addr", opts.health_addr), ("--metrics-addr", opts.metrics_addr)):
        if addr:
            ensure_port_free(*parse_hostport(addr, flag=flag), flag=flag)


class _NodeProcess(hivemind.DHT):
    """hivemind's DHT process; it must die on SIGTERM (hivemind's shutdown sends one if the node hangs), so the
    parent's handler, which only sets a stop flag, is reset in the forked child."""

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        tune_daemon_gc()  # this process starts the p2p daemon, with its environment
        super().run()


async def _node_status(_dht: hivemind.DHT, node: DHTNode, fellows: tuple[str, ...] = ()) -> tuple[int, int, int]:
    """(peers in the routing table, records stored here, fellow bootstrap nodes missing from the table), after a
    ping of each fellow missing from it (dht_join.ping_missing: a fellow started after this node, or restarted, is
    linked within a status period) and a lookup of a random key that contacts the nearest peers and drops dead
    ones from the table (as hivemind's own run_dht does)."""
    if fellows:
        await ping_missing(_dht, node, fellows, ())
    await node.get(f"_bootstrap_probe_{secrets.token_hex(8)}", latest=True)
    table = {peer.to_base58() for peer in node.protocol.routing_table.peer_id_to_uid}
    missing = {Multiaddr(m).value_for_protocol("p2p") for m in fellows} - table - {node.peer_id.to_base58()}
    return len(table), len(node.protocol.storage), len(missing)


@dataclass
class _Metrics:
    registry: Any
    up: Any
    peers: Any
    records: Any
    fellows_missing: Any
    server: Any = None

    @classmethod
    def create(cls, started: float) -> _Metrics:
        from prometheus_client import CollectorRegistry, Gauge

        registry = CollectorRegistry()
        metrics = cls(
            registry,
            Gauge("dilocox_bootstrap_up", "1 while the DHT node answers, else 0", registry=registry),
            Gauge("dilocox_bootstrap_routing_table_peers", "DHT peers in this node's routing table", registry=registry),
            Gauge("dilocox_bootstrap_stored_records", "DHT keys stored on this node", registry=registry),
            Gauge("dilocox_bootstrap_fellows_missing", "other bootstrap nodes (--initial-peers) not in the routing "
                  "table", registry=registry),
        )  # fmt: skip
        uptime = Gauge("dilocox_bootstrap_uptime_seconds", "seconds since this node started", registry=registry)
        uptime.set_function(lambda: time.time() - started)
        return metrics


@dataclass
class BootstrapNode:
    """A started bootstrap node; `start` does the checks, `serve` watches it, `stop` shuts it down."""

    opts: BootstrapOptions
    dht: hivemind.DHT
    health: GrpcEndpoint
    metrics: _Metrics
    peer_id: str
    maddrs: list[str] = field(default_factory=list)
    _peers_seen: int = -1
    _missing_seen: int = -1

    @classmethod
    def start(cls, opts: BootstrapOptions) -> BootstrapNode:
        """Check the flags and identity; start the DHT node, health (NOT_SERVING until Hello is served) and metrics.

        Raises:
            ConfigError, IdentityError: a flag, port or key file the user must fix.
            SwarmError: the p2p daemon did not start (other bootstrap nodes that are down are asked again later).
        """
        _check_flags(opts)
        route_hivemind_logs()
        peer_id = _prepare_state(opts)
        dht = _start_dht(opts, peer_id)  # first: it forks, which a running gRPC server (health) does not survive
        try:
            health, metrics = _start_endpoints(opts)
        except BaseException:
            dht.shutdown()
            raise
        node = cls(opts, dht, health, metrics, peer_id)
        node._announce()
        return node

    def _announce(self) -> None:
        serve_hello(self.dht, role="bootstrap")
        self.maddrs = reachable_maddrs(self.dht)
        write_atomically(self.opts.state_dir / "multiaddrs.txt", "".join(m + "\n" for m in self.maddrs))
        logger.info("DHT node up%s; peers join with --initial-peers %s",
                    " (circuit relay for --auto-relay peers)" if self.opts.relay else "", self.maddrs[0])  # fmt: skip
        self.refresh()

    def refresh(self) -> bool:
        """Ask the node for its routing table; set health and metrics from the answer. Returns whether it answered."""
        status = None
        if self.dht.is_alive():
            status_of = functools.partial(_node_status, fellows=self.opts.initial_peers)
            future = self.dht.run_coroutine(status_of, return_future=True)
            try:
                status = future.result(timeout=STATUS_TIMEOUT_S)
            except Exception as e:
                future.cancel()
                logger.warning("the DHT node did not report its status within %.0f s: %r", STATUS_TIMEOUT_S, e)
        self.health.set_serving(status is not None)
        self.metrics.up.set(1 if status is not None else 0)
        if status is not None:
            peers, records, missing = status
            self.metrics.peers.set(peers)
            self.metrics.records.set(records)
            self.metrics.fellows_missing.set(missing)
            if peers != self._peers_seen:
                logger.info("routing table: %d peer(s), %d record(s) stored here", peers, records)
                self._peers_seen = peers
            if missing != self._missing_seen and self.opts.initial_peers:
                self._say_fellows(missing)
                self._missing_seen = missing
        return status is not None

    def _say_fellows(self, missing: int) -> None:
        fellows = len(self.opts.initial_peers)
        if missing:
            logger.warning("%d of the %d other bootstrap nodes (--initial-peers) do not answer yet; serving without "
                           "them (this node may be the swarm's first) and asking them again every %.0f s",
                           missing, fellows, self.opts.status_period)  # fmt: skip
        else:
            logger.info("linked to all %d other bootstrap node(s)", fellows)

    def serve(self, stop: threading.Event) -> int:
        """Watch the node until `stop` is set (exit code 0) or its DHT process dies (1)."""
        while not stop.wait(self.opts.status_period):
            self.refresh()
            if not self.dht.is_alive():
                logger.error("the DHT process exited (code %s); restart dilocox-bootstrap (systemd: Restart=on-failure)",
                             self.dht.exitcode)  # fmt: skip
                return 1
        return 0

    def stop(self) -> None:
        """NOT_SERVING first (load balancers drain), then the DHT node and p2p daemon, then the endpoints."""
        self.health.set_serving(False)
        self.metrics.up.set(0)
        self.dht.shutdown()
        self.health.stop(grace=0.5)
        if self.metrics.server is not None:
            self.metrics.server.shutdown()
        logger.info("stopped")


def _prepare_state(opts: BootstrapOptions) -> str:
    """Create the state directory (0700) and the identity; return the peer id."""
    try:
        opts.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--state-dir {opts.state_dir}: cannot create it ({e.strerror}); pass a writable directory") from None
    existed = opts.identity_path.exists()
    peer_id = peer_id_of(load_node_identity(opts.identity_path))
    set_log_context(peer=peer_id)
    logger.info("identity %s (%s): peer id %s", opts.identity_path, "loaded" if existed else "created", peer_id)
    return peer_id


def _start_endpoints(opts: BootstrapOptions) -> tuple[GrpcEndpoint, _Metrics]:
    """gRPC health (NOT_SERVING; its address written to STATE_DIR/health.addr) and, if asked, Prometheus."""
    metrics = _Metrics.create(time.time())
    health = GrpcEndpoint.start(opts.health_addr, flag="--health-addr")
    health.set_serving(False)
    try:
        write_atomically(opts.state_dir / "health.addr", health.address + "\n")
        logger.info("gRPC health at %s (written to %s)", health.address, opts.state_dir / "health.addr")
        if opts.metrics_addr:
            metrics.server, where = start_metrics_http(opts.metrics_addr, metrics.registry)
            logger.info("Prometheus metrics at http://%s/metrics", where)
    except BaseException:
        health.stop(grace=0)
        raise
    return health, metrics


def _start_dht(opts: BootstrapOptions, peer_id: str) -> hivemind.DHT:
    """The DHT node, started alone: its fellow bootstrap nodes are joined once it runs (`BootstrapNode._link`),
    so that it starts though they are all down (it may be the swarm's first)."""
    kwargs: dict[str, Any] = dict(
        host_maddrs=list(opts.host_maddrs),
        announce_maddrs=list(opts.announce_maddrs) or None,
        identity_path=str(opts.identity_path),
        check_if_identity_free=False,  # hivemind's check reads RSA keys only; the key file is this node's own
        node_id=node_id_of(peer_id),  # one id in every life (swarm.dht)
        start=True,
        startup_timeout=30,
    )
    if opts.relay:
        kwargs.update(use_relay=True, force_reachability="public")
    patch_for_dht_node()  # swarm.hivemind_patches: before the DHT process forks and its first MPFuture
    try:
        return _NodeProcess(**kwargs)
    except Exception as e:  # hivemind raises P2PDaemonError, RuntimeError, ValueError...
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SwarmError(f"could not start the DHT node on {' '.join(opts.host_maddrs)}: {text}") from None
