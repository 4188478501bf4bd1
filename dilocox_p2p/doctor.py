"""Preflight checks before joining a swarm (`dilocox-peer doctor`), each a PASS / WARN / FAIL line.

    checks = run_checks(cfg, timeout=5.0)       # ports, announce address, initial peers, reachability, clock, memory, disk
    print("\n".join(c.line() for c in checks)); ok = not any(c.status == "FAIL" for c in checks)

Pure rules (address scopes, announce-address rules, memory and checkpoint estimates, the
clock bound) are separate functions with unit tests; the probes around them touch the
machine (ports, /proc/meminfo, CUDA, disk) and the network (TCP, libp2p, Hello).
`dilocox-bootstrap` reuses the address parsing and port checks on its own flags.

hivemind internals used here (hivemind 1.1.11-1.1.12): `P2P._client.connect(peer_id, maddrs)`,
the daemon's dial of one address, as hivemind's own `P2P.is_identity_taken` uses it; P2P
has no public call that dials a given address without bootstrapping to it.
"""

from __future__ import annotations

import asyncio
import calendar
import inspect
import ipaddress
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from multiaddr import Multiaddr

from .config import Config
from .endpoints import (
    HOST_PROTOCOLS, ensure_port_free, format_hostport, maddr_host, parse_hostport, resolve_host, stage_maddr,
)  # fmt: skip
from .errors import ConfigError
from .memory_estimate import DEVICE_BYTES_PER_PARAM, HOST_BYTES_PER_PARAM, available_ram, estimate_memory, gib

__all__ = [
    "Check",
    "PeerAddress",
    "address_scope",
    "announce_checks",
    "clock_check",
    "disk_check",
    "hello_verdict",
    "listen_hostport",
    "memory_check",
    "parse_peer_maddr",
    "run_checks",
]

Status = Literal["PASS", "WARN", "FAIL"]
Scope = Literal["loopback", "private", "public", "unspecified", "name"]

MAX_CLOCK_SKEW_S = 10.0
"""hivemind DHT records carry absolute expiration times (member records live 15 s): a clock off by more
than this makes records expire early or linger."""
RELEASE_YEAR = 2026
"""The year of this release: a clock that reads an earlier year is certainly wrong."""
MEMORY_MARGIN = 0.8
"""Above this share of free memory: WARN (activations, CUDA context and allocator slack are not estimated)."""


@dataclass(frozen=True, slots=True)
class Check:
    """One checked fact: `what` was checked, `detail` what was found, `fix` how to repair a WARN/FAIL."""

    status: Status
    what: str
    detail: str = ""
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status}  {self.what}"
        if self.detail:
            text += f": {self.detail}"
        if self.fix:
            text += f". Fix: {self.fix}"
        return text

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


# ----- addresses (pure) -------------------------------------------------------------------------
def address_scope(host: str) -> Scope:
    """Where an address can be reached from: loopback (this machine), private (a LAN: RFC 1918, link-local,
    CGNAT, ULA, documentation ranges), public (the internet), unspecified (0.0.0.0, ::) or a DNS name."""
    if host == "localhost":
        return "loopback"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return "name"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    return "public" if ip.is_global else "private"


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """A complete initial-peer multiaddr: /ip4|ip6|dns/HOST/tcp/PORT/p2p/PEER_ID."""

    text: str
    host: str
    port: int
    peer_id: str

    @property
    def dial_maddr(self) -> Multiaddr:
        """The address without its /p2p part (what the daemon dials)."""
        m = Multiaddr(self.text)
        return m.decapsulate(Multiaddr(f"/p2p/{self.peer_id}"))


def parse_peer_maddr(text: str) -> PeerAddress:
    """Parse an initial peer's multiaddr; ValueError says what is missing or malformed."""
    try:
        m = Multiaddr(text)
    except Exception as e:  # the multiaddr package raises several types
        raise ValueError(f"not a multiaddr ({e})") from None
    names = [p.name for p in m.protocols()]
    host_proto = next((n for n in names if n in HOST_PROTOCOLS), None)
    if host_proto is None:
        raise ValueError("names no host: it must start with /ip4/, /ip6/ or /dns/")
    if "tcp" not in names:
        raise ValueError("names no TCP port: expected /ip4/HOST/tcp/PORT/p2p/PEER_ID")
    if "p2p" not in names:
        raise ValueError("lacks the peer id: copy the whole address, ending in /p2p/<peer id>, from multiaddrs.txt")
    port = int(m.value_for_protocol("tcp"))
    if port == 0:
        raise ValueError("has TCP port 0: a node listens on a fixed port; copy its address from multiaddrs.txt")
    return PeerAddress(text, str(m.value_for_protocol(host_proto)), port, str(m.value_for_protocol("p2p")))


def listen_hostport(maddr: str) -> tuple[str, int] | None:
    """(host, port) of a listen multiaddr with a fixed TCP port; None for port 0 or no TCP."""
    m = Multiaddr(maddr)
    names = [p.name for p in m.protocols()]
    host_proto = next((n for n in names if n in HOST_PROTOCOLS), None)
    if host_proto is None or "tcp" not in names or int(m.value_for_protocol("tcp")) == 0:
        return None
    return str(m.value_for_protocol(host_proto)), int(m.value_for_protocol("tcp"))


def _maddr_port(maddr: str) -> str:
    m = Multiaddr(maddr)
    return str(m.value_for_protocol("tcp")) if "tcp" in [p.name for p in m.protocols()] else "PORT"


def announce_checks(
    initial_hosts: Sequence[str],
    announce_maddrs: Sequence[str],
    host_maddrs: Sequence[str],
    *,
    auto_relay: bool,
    route_source: str | None,
) -> list[Check]:
    """Can the initial peers dial this peer back at the addresses it will announce?

    Args:
        initial_hosts: the initial peers' hosts (IP addresses where resolved, else names).
        announce_maddrs: --announce-maddrs (empty: the node announces its listen addresses).
        host_maddrs: --host-maddrs.
        auto_relay: --auto-relay (reachable through relays when behind NAT).
        route_source: the local address this machine sends from towards a public initial peer (any remote one
            when none is public); None when unknown.
    """
    what = "announce address"
    if not initial_hosts:
        return [Check("PASS", what, "no --initial-peers: this peer starts a new swarm; others join at its printed addresses")]
    remote = [h for h in initial_hosts if address_scope(h) != "loopback"]
    public = [h for h in initial_hosts if address_scope(h) in ("public", "name")]
    if announce_maddrs:
        return _explicit_announce_checks(announce_maddrs, remote, public, route_source) or [
            Check("PASS", what, f"{' '.join(announce_maddrs)} can be dialed from the initial peers' networks")
        ]
    listen = [maddr_host(m) for m in host_maddrs]
    if remote and all(address_scope(h) == "loopback" for h in listen):
        port = _maddr_port(host_maddrs[0])
        return [Check("FAIL", what, f"this peer listens on loopback only ({' '.join(host_maddrs)}) but initial peer "
                      f"{remote[0]} is on another machine", f"pass --host-maddrs /ip4/0.0.0.0/tcp/{port}")]  # fmt: skip
    if public and route_source is not None and address_scope(route_source) == "private":
        if auto_relay:
            return [Check("PASS", what, f"behind NAT (this machine is {route_source}); reachable through the initial "
                          "peers' relays (--auto-relay)")]  # fmt: skip
        return [Check("WARN", what, f"the initial peers are on the internet but this machine has no public address "
                      f"(it sends from {route_source}, behind NAT): they may not be able to dial it",
                      "forward a TCP port to this machine and pass --host-maddrs /ip4/0.0.0.0/tcp/PORT "
                      "--announce-maddrs /ip4/PUBLIC_IP/tcp/PORT, or pass --auto-relay")]  # fmt: skip
    return [Check("PASS", what, "no --announce-maddrs: the listen addresses are announced; they fit the initial peers")]


def _host_part(ip: str | None) -> str:
    """The /ip4|ip6/ADDRESS part of a multiaddr for this machine's address (a placeholder when unknown)."""
    if ip is None or address_scope(ip) == "loopback":
        return "/ip4/THIS_MACHINE_IP"
    return f"/ip6/{ip}" if ":" in ip else f"/ip4/{ip}"


def _explicit_announce_checks(
    announce_maddrs: Sequence[str], remote: Sequence[str], public: Sequence[str], route_source: str | None
) -> list[Check]:
    checks = []
    for maddr in announce_maddrs:
        what, scope, port = f"announce address {maddr}", address_scope(maddr_host(maddr)), _maddr_port(maddr)
        mine = _host_part(route_source)
        if port == "0":
            checks.append(Check("FAIL", what, "announces TCP port 0, which nobody can dial",
                                "announce the fixed port this peer listens on (a fixed port in --host-maddrs too)"))  # fmt: skip
        elif scope in ("loopback", "unspecified") and remote:
            checks.append(Check("FAIL", what, f"is {scope}, but initial peer {remote[0]} is on another machine and "
                                "cannot dial it there",
                                f"pass --announce-maddrs {mine}/tcp/{port} (an address of this machine that "
                                f"{remote[0]} can reach), or leave --announce-maddrs out"))  # fmt: skip
        elif scope == "private" and public:
            checks.append(Check("FAIL", what, f"is a private address, but initial peer {public[0]} is on the internet "
                                "and cannot dial it",
                                f"forward TCP port {port} on your router to this machine and pass --announce-maddrs "
                                f"/ip4/PUBLIC_IP/tcp/{port}, or pass --auto-relay"))  # fmt: skip
    return checks


# ----- memory and disk (pure) -------------------------------------------------------------------
def memory_check(what: str, need: int, free: int, *, basis: str) -> Check:
    """FAIL when `need` bytes exceed `free`; WARN above MEMORY_MARGIN of it (unestimated overheads)."""
    found = f"needs ~{gib(need)} ({basis}), {gib(free)} free"
    fix = "use more --stages (each holds fewer layers), a smaller --preset, or a machine with more memory"
    if need > free:
        return Check("FAIL", what, found, fix)
    if need > MEMORY_MARGIN * free:
        return Check("WARN", what, found + "; activations and allocator overhead may not fit", fix)
    return Check("PASS", what, found)


def disk_check(path: Path, need: int, free: int, *, checkpoints_kept: int) -> Check:
    """FAIL when the checkpoints of `path` would not fit in `free` bytes."""
    what = f"disk for checkpoints in {path}"
    found = f"needs ~{gib(need)} ({checkpoints_kept} kept + 1 being written, per stage), {gib(free)} free"
    if need > free:
        return Check("FAIL", what, found, "free space there, or pass a --run-dir on a larger filesystem")
    return Check("PASS", what, found)


def hello_verdict(what: str, reply: Any, *, ours: int, run_id: str, round_trip: float) -> Check:
    """Judge a node's HelloReply: a dilocox node speaking protocol `ours` passes; a peer of another run warns."""
    from .swarm.hello import SOFTWARE

    to_dilocox = "point --initial-peers at a dilocox-bootstrap or a dilocox-peer node"
    if reply.software != SOFTWARE:
        return Check("FAIL", what, f"reachable but not a dilocox node (it runs {reply.software!r})", to_dilocox)
    if reply.protocol != ours:
        side = "this machine" if reply.protocol > ours else "that node"
        return Check("FAIL", what, f"runs incompatible version {reply.version} (protocol {reply.protocol}, ours {ours})",
                     f"upgrade dilocox-p2p on {side} so both speak the same protocol")  # fmt: skip
    found = f"dilocox {reply.role} {reply.version}, protocol {reply.protocol}, round trip {1000 * round_trip:.0f} ms"
    if reply.role == "peer" and reply.run_id and reply.run_id != run_id:
        return Check("WARN", what, f"{found}; it trains run {reply.run_id!r}, not {run_id!r}",
                     "fine as an entry point; check --run-id if you meant to join its run")  # fmt: skip
    return Check("PASS", what, found)


def clock_check(skews: Mapping[str, float], *, now: float, bound: float = MAX_CLOCK_SKEW_S) -> Check:
    """The clock is within `bound` seconds of every answering initial peer; without one, not before RELEASE_YEAR."""
    fix = "synchronize the clock (`timedatectl set-ntp true`, or run chrony/ntpd)"
    if not skews:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
        if now < calendar.timegm((RELEASE_YEAR, 1, 1, 0, 0, 0)):
            return Check("FAIL", "clock", f"reads {stamp}, before this release ({RELEASE_YEAR})", fix)
        return Check("PASS", "clock", f"reads {stamp} (no initial peer answered to compare with)")
    peer, skew = max(skews.items(), key=lambda kv: abs(kv[1]))
    found = f"largest offset {skew:+.2f} s against {peer} (bound {bound:.0f} s; DHT records expire by absolute time)"
    if abs(skew) > bound:
        return Check("FAIL", "clock", found, fix)
    return Check("PASS", "clock", f"within {abs(skew):.2f} s of {len(skews)} initial peer(s) (bound {bound:.0f} s)")


# ----- probes of this machine -------------------------------------------------------------------
def fixed_ports(cfg: Config) -> list[tuple[str, str, str, int]]:
    """(what, flag, host, port) of every fixed TCP port a peer with `cfg` listens on: each stage's DHT
    (PORT + stage), control, metrics. Port 0 (any free port) is left out."""
    wanted: list[tuple[str, str, str, int]] = []
    for maddr in cfg.swarm.host_maddrs if cfg.swarm.enabled else ():
        for stage in range(cfg.model.stages):
            hp = listen_hostport(stage_maddr(maddr, stage))
            if hp is not None:
                wanted.append((f"stage {stage} DHT", "--host-maddrs", *hp))
    for name, flag, addr in (("control", "--control-addr", cfg.control.control_addr),
                             ("metrics", "--metrics-addr", cfg.control.metrics_addr)):  # fmt: skip
        if addr:
            host, port = parse_hostport(addr, flag=flag)
            if port:
                wanted.append((name, flag, host, port))
    return wanted


def port_checks(cfg: Config) -> list[Check]:
    """Every fixed TCP port this peer will listen on is free."""
    wanted = fixed_ports(cfg)
    if not wanted:
        return [Check("PASS", "ports", "every listen address picks a free port (port 0)")]
    return [_port_check(*w) for w in wanted]


def _port_check(name: str, flag: str, host: str, port: int) -> Check:
    what = f"port {format_hostport(host, port)} free ({name}, {flag})"
    try:
        ensure_port_free(host, port, flag=flag)
    except ConfigError as e:
        return Check("FAIL", what, str(e).split(": ", 1)[-1])
    return Check("PASS", what)


def route_source(host: str) -> str | None:
    """The local address this machine sends from towards `host` (a UDP connect picks the route; nothing is sent)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def memory_checks(cfg: Config) -> list[Check]:
    """The preset's stage memory against free device memory (CUDA) and available RAM."""
    import torch

    from .checkpoint import save_checkpoint

    kept = int(inspect.signature(save_checkpoint).parameters["keep"].default)
    want_cuda = bool(cfg.run.devices) or cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        return [Check("FAIL", "device cuda", "no CUDA device is visible to this process",
                      "check the driver (`nvidia-smi`) and CUDA_VISIBLE_DEVICES, or pass --device cpu")]  # fmt: skip
    est = estimate_memory(cfg.model.shape, cfg.model.stages, on_cuda=want_cuda, checkpoints_kept=kept,
                          compressed=cfg.compression.kind != "none")  # fmt: skip
    per_param = sum(DEVICE_BYTES_PER_PARAM.values())
    checks = []
    stages, replicas = cfg.model.stages, cfg.run.replicas
    if want_cuda:  # every stage process (replica r's stage s: rank r x stages + s) on its GPU (peer_layout.py)
        count = torch.cuda.device_count()
        on: dict[int, list[int]] = {}
        for rank in range(stages * replicas):
            index = torch.device(cfg.run.devices[rank]).index if cfg.run.devices else rank % count
            on.setdefault(index, []).append(rank)
        for index, ranks in sorted(on.items()):
            if index >= count:
                continue  # resolve_device refuses it at start, naming the GPUs it sees
            need = sum(est.device_bytes[rank % stages] for rank in ranks)
            free = int(torch.cuda.mem_get_info(index)[0])
            held = ", ".join(f"{rank % stages}" + (f" of replica {rank // stages}" if rank >= stages else "") for rank in ranks)
            what = f"GPU memory cuda:{index} (stage {held}, preset {cfg.model.preset})"
            checks.append(memory_check(what, need, free, basis=f"{per_param} B/param: {_basis(DEVICE_BYTES_PER_PARAM)}"))
    host_basis = _basis(HOST_BYTES_PER_PARAM) + ("" if want_cuda else f", + {_basis(DEVICE_BYTES_PER_PARAM)}")
    # on CPU each replica's copies train in RAM too; the outer state is replica 0's alone
    host = est.host_bytes + (0 if want_cuda else (replicas - 1) * sum(est.device_bytes))
    copies = f" x {replicas} replicas" if replicas > 1 else ""
    what = f"RAM ({stages} stage(s){copies}, {sum(est.stage_params) / 1e6:.1f}M params, preset {cfg.model.preset})"
    checks.append(memory_check(what, host, available_ram(), basis=host_basis))
    run_dir = cfg.run.path.resolve()
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    checks.append(disk_check(run_dir, est.checkpoint_bytes, shutil.disk_usage(existing).free, checkpoints_kept=kept))
    return checks


def _basis(parts: Mapping[str, int]) -> str:
    return " + ".join(f"{name} {n}" for name, n in parts.items())


# ----- probes of the initial peers --------------------------------------------------------------
@dataclass
class _PeerResult:
    check: Check
    skew: float | None = None
    down: bool = False
    """Nothing (or no libp2p node of this id) answers at the address: harmless while another initial peer does."""


async def _tcp_reachable(addr: PeerAddress, timeout: float) -> str | None:
    """None when a TCP connection to the peer's host:port opens within `timeout`, else why not."""
    where = format_hostport(addr.host, addr.port)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(addr.host, addr.port), timeout)
    except asyncio.TimeoutError:
        return f"no answer at {where} within {timeout:.0f} s"
    except ConnectionRefusedError:
        return f"connection to {where} refused: nothing listens there"
    except socket.gaierror as e:
        return f"cannot resolve {addr.host} ({e.strerror})"
    except OSError as e:
        return f"cannot connect to {where} ({e.strerror or e})"
    writer.close()
    return None


async def _probe_peer(addr: PeerAddress, timeout: float, run_id: str) -> _PeerResult:
    """TCP, then a libp2p connection, then Hello: the first step that fails names the problem.

    Each address gets its own short-lived p2p daemon: a daemon already connected to a peer id would
    not dial another (possibly dead) address of the same node.
    """
    from hivemind.p2p import P2P

    unreachable = await _tcp_reachable(addr, timeout)
    if unreachable:
        return _PeerResult(Check("FAIL", f"initial peer {addr.text}", unreachable + ": the node is down, the address "
                                 "is stale or a firewall blocks the port", "start the node (or copy its current "
                                 f"address from its multiaddrs.txt) and open TCP port {addr.port} to this machine"),
                           down=True)  # fmt: skip
    try:
        p2p = await asyncio.wait_for(P2P.create(dht_mode="client", auto_nat=False, nat_port_map=False), 30)
    except Exception as e:  # P2PDaemonError, TimeoutError: this machine's problem, not the peer's
        return _PeerResult(Check("FAIL", f"initial peer {addr.text}", f"could not start a local p2p daemon to test it "
                                 f"({_short(e)})", "check that hivemind's p2pd runs on this machine "
                                 "(`pip install --force-reinstall hivemind`)"))  # fmt: skip
    try:
        return await _hello_check(p2p, addr, timeout, run_id)
    finally:
        await p2p.shutdown()


async def _hello_check(p2p: Any, addr: PeerAddress, timeout: float, run_id: str) -> _PeerResult:
    from hivemind.p2p import PeerID

    from .swarm.hello import SOFTWARE, say_hello
    from .wire import protocol_version

    what = f"initial peer {addr.text}"
    peer_id = PeerID.from_base58(addr.peer_id)
    try:
        await asyncio.wait_for(p2p._client.connect(peer_id, [addr.dial_maddr]), timeout)
    except Exception as e:
        return _PeerResult(Check("FAIL", what, f"the port is open but no libp2p node with this peer id answers there "
                                 f"({_short(e)})", "copy the node's current address (with its /p2p/ peer id) "
                                 "from its multiaddrs.txt"), down=True)  # fmt: skip
    sent = time.time()
    try:
        reply = await say_hello(p2p, peer_id, timeout)
    except Exception as e:
        return _PeerResult(Check("FAIL", what, f"reachable but not a dilocox node: it does not answer Hello "
                                 f"({_short(e)})", "point --initial-peers at a dilocox-bootstrap or a dilocox-peer "
                                 "node"))  # fmt: skip
    received = time.time()
    check = hello_verdict(what, reply, ours=protocol_version(), run_id=run_id, round_trip=received - sent)
    return _PeerResult(check, reply.time - (sent + received) / 2 if reply.software == SOFTWARE else None)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]


async def _probe_all(addrs: Sequence[PeerAddress], timeout: float, run_id: str) -> list[_PeerResult]:
    return list(await asyncio.gather(*(_probe_peer(a, timeout, run_id) for a in addrs)))


def peer_checks(cfg: Config, timeout: float) -> tuple[list[Check], dict[str, float]]:
    """One check per initial peer (well formed, reachable, a dilocox node of our protocol) and the clock offsets."""
    checks, addrs = [], []
    for text in cfg.swarm.initial_peers:
        try:
            addrs.append(parse_peer_maddr(text))
        except ValueError as e:
            checks.append(Check("FAIL", f"initial peer {text}", str(e), "pass /ip4/HOST/tcp/PORT/p2p/PEER_ID"))
    if not addrs:
        return checks, {}
    results = asyncio.run(_probe_all(addrs, timeout, cfg.run.run_id))
    skews = {a.text: r.skew for a, r in zip(addrs, results) if r.skew is not None}
    if any(r.check.status == "PASS" for r in results):  # joining needs one: the others down are a warning
        for r in results:
            if r.down:
                r.check = replace(r.check, status="WARN",
                                              detail=r.check.detail + "; this peer joins through the others")  # fmt: skip
    checks += [r.check for r in results]
    live = next((a for a, r in zip(addrs, results) if r.check.status == "PASS"), None)
    if live is not None:  # can the swarm dial this machine? (swarm/dial_back.py)
        from .swarm.dial_back import reachability_check

        reach = reachability_check(cfg, live, timeout=timeout, local_host=route_source(resolve_host(live.host)))
        checks += [reach] if reach is not None else []
    return checks, skews


def run_checks(cfg: Config, *, timeout: float = 5.0) -> list[Check]:
    """All preflight checks for joining with `cfg`, in the order an operator fixes them."""
    checks = port_checks(cfg)
    hosts = [resolve_host(parse_peer_maddr(t).host) for t in cfg.swarm.initial_peers if _parses(t)]
    # the local address towards a public initial peer (behind NAT if private), else towards any remote one
    remote = sorted((h for h in hosts if address_scope(h) != "loopback"), key=lambda h: address_scope(h) != "public")
    checks += announce_checks(hosts, cfg.swarm.announce_maddrs, cfg.swarm.host_maddrs, auto_relay=cfg.swarm.auto_relay,
                              route_source=route_source(remote[0]) if remote else None)  # fmt: skip
    found, skews = peer_checks(cfg, timeout)
    checks += found
    checks.append(clock_check(skews, now=time.time()))
    checks += memory_checks(cfg)
    return checks


def _parses(text: str) -> bool:
    try:
        parse_peer_maddr(text)
    except ValueError:
        return False
    return True
