"""The local network endpoints an operator points tools at: gRPC servers with health, Prometheus.

    host, port = parse_hostport("127.0.0.1:0", flag="--control-addr")
    ensure_port_free(host, port, flag="--control-addr")        # ConfigError naming the fix
    server = GrpcEndpoint.start("127.0.0.1:0", add=lambda s: add_XServicer_to_server(x, s))
    server.address                                            # "127.0.0.1:41234" (the bound port)
    server.set_serving(False); server.stop()
    http = start_metrics_http("0.0.0.0:9400", registry)       # GET /metrics

Every server here also serves the standard `grpc.health.v1.Health` service, so that
`grpc_health_probe`, Kubernetes and Docker health checks work unchanged.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import secrets
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from multiaddr import Multiaddr

from .errors import ConfigError, DilocoxError

__all__ = [
    "HOST_PROTOCOLS", "GrpcEndpoint", "bindable", "ensure_port_free", "fix_stage_ports", "format_hostport", "free_ports",
    "local_maddr", "loopback_only", "maddr_host", "parse_hostport", "start_metrics_http", "write_atomically",
]


def parse_hostport(text: str, *, flag: str) -> tuple[str, int]:
    """`HOST:PORT` (IPv6 as `[::1]:PORT`) -> (host, port); a ConfigError names `flag` when malformed."""
    host, sep, port_text = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{flag} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:0 (port 0 picks a free one)")
    return host, int(port_text)


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _family(host: str) -> int:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET  # a host name: resolved by bind


LOWEST_PICKED_PORT = 10_000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_ports(host: str, consecutive: int = 1) -> int:
    """A port P such that P .. P + consecutive - 1 are free on `host` now (a peer's stage s listens on P + s).

    Picked at random below the kernel's ephemeral range where there is one: the kernel hands out every port
    it picks by itself (an outgoing connection, another program's bind to port 0) from that range, so one of
    those cannot take P between this check and the moment the stage binds it. A port asked of the kernel was
    taken that way once: a peer started beside two others failed with "address already in use"."""
    top = _ephemeral_low() - consecutive
    if top - LOWEST_PICKED_PORT >= 1000:
        for _ in range(100):
            port = LOWEST_PICKED_PORT + secrets.randbelow(top - LOWEST_PICKED_PORT)
            if all(bindable(host, port + i) for i in range(consecutive)):
                return port
    for _ in range(100):
        with socket.socket(_family(host)) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port + consecutive <= 65536 and all(bindable(host, port + i) for i in range(1, consecutive)):
            return port
    raise DilocoxError(f"found no {consecutive} consecutive free TCP ports on {host}")


def bindable(host: str, port: int) -> bool:
    """Whether a socket can bind HOST:PORT now."""
    with socket.socket(_family(host)) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ensure_port_free(host: str, port: int, *, flag: str) -> None:
    """Raise ConfigError (with the fix) if a TCP listener cannot bind HOST:PORT. Port 0 always passes."""
    if port == 0:
        return
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            where = format_hostport(host, port)
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"{flag} {where}: the port is in use by another process; stop it (find it with "
                    f"`ss -ltnp 'sport = :{port}'`) or pass another port"
                ) from None
            raise ConfigError(f"{flag} {where}: cannot listen there ({e.strerror}); pass an address of this machine") from None


@dataclass
class GrpcEndpoint:
    """A started gRPC server with the health service; `address` holds the port actually bound."""

    server: grpc.Server
    health: health.HealthServicer
    address: str

    @classmethod
    def start(
        cls, addr: str, *, flag: str, add: Callable[[grpc.Server], Any] = lambda s: None, workers: int = 8,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
    ) -> GrpcEndpoint:  # fmt: skip
        host, port = parse_hostport(addr, flag=flag)
        ensure_port_free(host, port, flag=flag)
        server = grpc.server(ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"), interceptors=interceptors)
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        add(server)
        try:
            bound = server.add_insecure_port(format_hostport(host, port))
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise ConfigError(f"{flag} {addr}: gRPC could not listen there; pass a free port of this machine")
        server.start()
        endpoint = cls(server, servicer, format_hostport(host, bound))
        endpoint.set_serving(True)
        return endpoint

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)

    def stop(self, grace: float = 1.0) -> None:
        self.set_serving(False)
        self.server.stop(grace).wait(grace + 1.0)


def start_metrics_http(addr: str, registry: Any, *, flag: str = "--metrics-addr") -> tuple[Any, str]:
    """Serve `registry` at http://ADDR/metrics (Prometheus text format); return (server, bound address)."""
    from prometheus_client import start_http_server

    host, port = parse_hostport(addr, flag=flag)
    ensure_port_free(host, port, flag=flag)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, format_hostport(host, server.server_port)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` (an address file) through a temp file and a rename: readers see the old or the new
    file, whole."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


def resolve_host(host: str) -> str:
    """`host`'s first address (a name resolved; an address as it is, or the name where it does not resolve)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return host


def maddr_host(maddr: str) -> str:
    """The host (IP address or DNS name) of a multiaddr; "" if it names none."""
    m = Multiaddr(maddr)
    proto = next((p.name for p in m.protocols() if p.name in HOST_PROTOCOLS), None)
    return str(m.value_for_protocol(proto)) if proto else ""


def loopback_only(maddrs: Sequence[str]) -> bool:
    """Whether every one of `maddrs` is an /ip4 or /ip6 address on loopback (a DNS name is not taken as one)."""
    try:
        return bool(maddrs) and all(ipaddress.ip_address(maddr_host(m)).is_loopback for m in maddrs)
    except ValueError:  # a DNS name, no host, or not a multiaddr
        return False


def stage_maddr(maddr: str, stage: int) -> str:
    """Stage s listens on PORT + s when a fixed TCP port is given (port 0 stays random)."""
    parts = maddr.split("/")
    for i in range(len(parts) - 1):
        if parts[i] in ("tcp", "udp") and parts[i + 1].isdigit() and int(parts[i + 1]) != 0:
            parts[i + 1] = str(int(parts[i + 1]) + stage)
    return "/".join(parts)


def fix_stage_ports(maddrs: Sequence[str], stages: int) -> tuple[str, ...]:
    """`maddrs` with each random TCP port (tcp/0) replaced by a base port P whose P .. P + stages - 1 are free now,
    so that every stage's address (stage_maddr) is known before any stage listens."""
    fixed = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 4 and parts[3] == "tcp" and parts[4] == "0" and parts[1] in ("ip4", "ip6"):
            parts[4] = str(free_ports(parts[2], stages))
        fixed.append("/".join(parts))
    return tuple(fixed)


def local_maddr(maddr: str, peer_id: str) -> str | None:
    """How a process on this machine dials `maddr` (a listen address with a fixed TCP port; a wildcard host
    becomes loopback), as a full multiaddr of `peer_id`; None when it cannot say (DNS, QUIC, port 0)."""
    parts = maddr.split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or parts[4] in ("", "0"):
        return None
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(parts[2], parts[2])
    return f"/{parts[1]}/{host}/tcp/{parts[4]}/p2p/{peer_id}"
