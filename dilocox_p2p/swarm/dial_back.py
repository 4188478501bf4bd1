"""Dial-back: a node tells another whether it can open a connection to it (is it reachable, or behind a NAT?).

    await serve_dial_back(node.p2p)                                 # in the DHT process, beside Hello
    reply = await ask_dial_back(p2p, peer_id, [31337], timeout=8)   # from any P2P connected to that node
    check = reachability_verdict(reply, asked=[31337], local_host="172.16.2.2", via="12D3KooW...")

Most volunteers sit behind a home router with no open port: they can dial out, nobody can dial in,
and two such peers cannot reach each other. AutoNAT in the p2p daemon tells the daemon, not the
operator. The asker opens a libp2p stream to a node it reached (a bootstrap node, any peer) and
names at most MAX_PORTS ports; the node takes the asker's address from the stream's connection
(what it sees: a NAT's public address) and opens a plain TCP connection to each port there, each
within CONNECT_S. It never dials anything but the asker's own address, so it cannot be turned on a
third host. `dilocox-peer doctor` listens on the peer's port for the while and reports the verdict
with the fix.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from multiaddr import Multiaddr

from ..proto_gen.control_pb2 import DialBackReply, DialBackRequest, PortReach

__all__ = [
    "CONNECT_S", "DIAL_BACK", "MAX_PORTS", "ask_dial_back", "observed_host", "reachability_check", "reachability_verdict",
    "report_reachability", "serve_dial_back",
]  # fmt: skip

logger = logging.getLogger(__name__)

DIAL_BACK = "dilocox.v1.DialBack"
MAX_PORTS = 4
CONNECT_S = 3.0
REQUEST_S = 15.0  # how long a served stream may take to bring its request: an idle stream holds only a coroutine (no
# slot), and a node on a loaded machine took more than CONNECT_S to read one (CI run 185: the doctor saw no reply)
MAX_AT_ONCE = 8  # dial-backs served at once; more wait
ASKS, ASK_AGAIN_S = 5, 10.0  # a joining worker asks the initial peers this many times, this long apart, for a verdict
_slots: asyncio.Semaphore | None = None


def observed_host(addr: Any) -> str:
    """The IP of a connection's remote multiaddr ("" if it has none: relayed, or unreadable)."""
    try:
        maddr = Multiaddr(str(addr))
        if "p2p-circuit" in {p.name for p in maddr.protocols()}:
            return ""
        for proto in ("ip4", "ip6"):
            try:
                return str(ipaddress.ip_address(maddr.value_for_protocol(proto)))
            except Exception:  # noqa: BLE001 - not this protocol
                continue
    except Exception:  # noqa: BLE001 - an address the daemon could not name
        return ""
    return ""


async def _reach(host: str, port: int) -> PortReach:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_S)
    except asyncio.TimeoutError:
        return PortReach(port=port, error=f"no answer within {CONNECT_S:.0f} s (a firewall or NAT drops it)")
    except ConnectionRefusedError:
        return PortReach(port=port, error="refused (nothing listens there, or a router in front refuses it)")
    except OSError as e:
        return PortReach(port=port, error=f"cannot connect ({e.strerror or e})")
    writer.close()
    return PortReach(port=port, reachable=True)


async def _answer(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    from hivemind.p2p import P2P

    global _slots
    _slots = _slots or asyncio.Semaphore(MAX_AT_ONCE)
    try:
        request, error = await asyncio.wait_for(P2P.receive_protobuf(DialBackRequest, reader), REQUEST_S)
        if request is None:
            logger.debug("dial-back for %s not answered: %r", stream_info.peer_id, error)
            return
        host = observed_host(stream_info.addr)
        ports = [p for p in request.ports if 0 < p < 65536][:MAX_PORTS]
        reply = DialBackReply(observed_host=host)
        if host:
            async with _slots:
                reply.ports.extend(await asyncio.gather(*(_reach(host, p) for p in ports)))
        await P2P.send_protobuf(reply, writer)
        await writer.drain()
    except Exception as e:  # noqa: BLE001 - a stream that broke or a malformed request: the asker sees no reply
        logger.debug("dial-back for %s not answered: %r", stream_info.peer_id, e)
    finally:
        writer.close()


async def serve_dial_back(p2p: Any) -> None:
    """Answer DIAL_BACK on `p2p` (the DHT process's, so it lives as long as the node)."""
    await p2p.add_binary_stream_handler(DIAL_BACK, _answer)


async def ask_dial_back(p2p: Any, peer_id: Any, ports: Sequence[int], *, timeout: float) -> DialBackReply:
    """Ask `peer_id` (already connected) to dial this machine back at `ports` (at most MAX_PORTS).

    Raises:
        asyncio.TimeoutError: no reply within `timeout`.
        ConnectionError: the node closed the stream without a reply (it does not serve DIAL_BACK).
    """
    from hivemind.p2p import P2P

    async def ask() -> DialBackReply:
        _, reader, writer = await p2p.call_binary_stream_handler(peer_id, DIAL_BACK)
        try:
            await P2P.send_protobuf(DialBackRequest(ports=list(ports)[:MAX_PORTS]), writer)
            try:
                reply, error = await P2P.receive_protobuf(DialBackReply, reader)
            except asyncio.IncompleteReadError:
                reply, error = None, None
            if reply is None:
                raise ConnectionError(f"the node sent no dial-back reply{f' ({error.message})' if error else ''}")
            return reply
        finally:
            writer.close()

    return await asyncio.wait_for(ask(), timeout)


_AS_CLIENT = ("it averages as a client member (swarm.reachability), sending its parts and taking the average over "
              "connections it opens itself; it reduces nothing and leads no group, so its uplink carries less of the "
              "exchange")
_AS_FULL = ("with --reachability public it still averages as a full member, and its rounds with members that cannot "
            "reach it fail (drop --reachability public: it then averages as a client member)")


def reachability_verdict(
    reply: DialBackReply, *, asked: Sequence[int], local_host: str | None, via: str, picked: bool = False,
    reachability: str = "auto",
) -> Any:  # fmt: skip
    """The doctor's check from a dial-back `reply` to the `asked` ports (`local_host`: this machine's own address
    towards the swarm, when known; `via`: who dialed back; `picked`: the port stands in for one the peer picks;
    `reachability`: swarm.reachability, which says what an unreachable peer does)."""
    from ..doctor import Check

    what = "reachable from the swarm"
    if not reply.observed_host:
        return Check("WARN", what, f"{via} sees this machine only through a relay; it could not dial back",
                     "forward the listen port to this machine, or pass --announce-maddrs with an address others can dial")  # fmt: skip
    shut = [p for p in reply.ports if not p.reachable]
    if not shut and len(reply.ports) == len(asked):
        return Check("PASS", what, f"{via} opened a connection to {reply.observed_host} at port(s) "
                     f"{', '.join(str(p.port) for p in reply.ports)}")  # fmt: skip
    nat = local_host and local_host != reply.observed_host
    behind = (f"this machine is behind a NAT (its address {local_host}; the swarm sees {reply.observed_host}); "
              if nat else "")  # fmt: skip
    why = "; ".join(f"{reply.observed_host}:{p.port} {p.error}" for p in shut) or "no port was tried"
    ports = ", ".join(str(p) for p in asked)
    return Check(
        "WARN", what,
        f"{behind}{via} could not open a connection back ({why}). Other peers cannot dial this one: "
        + (_AS_FULL if reachability == "public" else _AS_CLIENT),
        f"forward TCP port {ports} on the router to this machine"
        + (f" and pin it with --host-maddrs /ip4/0.0.0.0/tcp/{asked[0]} (the peer picks a port now)" if picked else "")
        + ", or pass --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT for a mapping you made; --auto-relay reaches peers "
        "through a bootstrap node started with --relay",
    )  # fmt: skip


def _listen_target(cfg: Any) -> tuple[str, int]:
    """Where the peer's stage 0 will listen: (host, port), port 0 when it picks one (the probe then listens on any)."""
    from ..doctor import listen_hostport
    from ..endpoints import stage_maddr

    for maddr in cfg.swarm.host_maddrs:
        try:
            fixed = listen_hostport(stage_maddr(maddr, 0))
        except Exception:  # noqa: BLE001 - not a TCP address: another one may be
            continue
        if fixed is not None:
            return fixed
        try:
            m = Multiaddr(stage_maddr(maddr, 0))
            return str(m.value_for_protocol("ip6" if "ip6" in {p.name for p in m.protocols()} else "ip4")), 0
        except Exception:  # noqa: BLE001
            continue
    return "0.0.0.0", 0


class _CannotListen(Exception):
    """The probe could not listen where stage 0 will (the port in use, or an address not this machine's)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


async def _probe(addr: Any, listen: tuple[str, int], timeout: float) -> tuple[DialBackReply, int]:
    from hivemind.p2p import P2P, PeerID

    try:
        server = await asyncio.start_server(lambda _r, w: w.close(), *listen)
    except OSError as e:
        raise _CannotListen(e) from e
    port = server.sockets[0].getsockname()[1]
    try:
        p2p = await asyncio.wait_for(P2P.create(dht_mode="client", auto_nat=False, nat_port_map=False), 30)
        try:
            peer_id = PeerID.from_base58(addr.peer_id)
            await asyncio.wait_for(p2p._client.connect(peer_id, [addr.dial_maddr]), timeout)
            return await ask_dial_back(p2p, peer_id, [port], timeout=timeout + CONNECT_S), port
        finally:
            await p2p.shutdown()
    finally:
        server.close()


def reachability_check(cfg: Any, addr: Any, *, timeout: float, local_host: str | None) -> Any:
    """The doctor's check: listen where stage 0 will (a free port if it picks one), and ask the initial peer at
    `addr` (a doctor PeerAddress that answered Hello) to dial back. None when that port cannot be listened on
    (the port check says why)."""
    from ..doctor import Check

    listen = _listen_target(cfg)
    try:
        try:
            reply, port = asyncio.run(_probe(addr, listen, timeout))
        except (TimeoutError, ConnectionError):  # once more: a busy machine or node (join asks up to ASKS times)
            reply, port = asyncio.run(_probe(addr, listen, timeout))
    except _CannotListen as e:
        if listen[1]:
            return None  # in use, or not this machine's: port_checks reports it
        return Check("WARN", "reachable from the swarm", f"could not listen to test it ({e.error.strerror or e.error})")
    except Exception as e:  # noqa: BLE001 - an older node, a broken stream, a timeout: nothing known either way
        # (a timeout is an OSError: taken for the port's own error, the check was left out without a word: CI run 165)
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return Check("WARN", "reachable from the swarm", f"{addr.text} did not dial back ({text[:160]}): not tested",
                     "ask another initial peer (an up-to-date dilocox node)")  # fmt: skip
    return reachability_verdict(reply, asked=[port], local_host=local_host, via=f"initial peer {addr.host}",
                                picked=not listen[1], reachability=cfg.swarm.reachability)  # fmt: skip


async def _ask_first(_dht: Any, node: Any, initial: Sequence[str], port: int, timeout: float) -> tuple[str, bytes]:
    """In the DHT process: the dial-back reply (serialized: it crosses a process pipe) of the first of `initial`
    that gives one, and whose it is; ("", why the last one gave none) where none does."""
    from hivemind.p2p import PeerID

    why = b"no initial peer"
    for text in initial:
        try:
            peer = PeerID.from_base58(Multiaddr(text).value_for_protocol("p2p"))
            return text, (await ask_dial_back(node.p2p, peer, [port], timeout=timeout)).SerializeToString()
        except Exception as e:  # noqa: BLE001 - down, or an older node: the next one may answer
            logger.debug("no dial-back from %s: %r", text, e)
            why = f"{text}: {e!r}"[:200].encode()
    return "", why


def report_reachability(
    dht: Any, initial: Sequence[str], *, timeout: float = 2 * CONNECT_S + 2,
    on_verdict: Callable[[bool, str], None] | None = None,
) -> None:  # fmt: skip
    """Ask the swarm, in the background, to dial this worker's DHT node back, and log what it found: a warning with
    the fix when it cannot (behind NAT: other peers cannot open connections to it), one line when it can. Then
    `on_verdict(reachable, what was found)`, unless nobody answered (nothing is known)."""
    from ..doctor import parse_peer_maddr, route_source
    from ..endpoints import resolve_host
    from .dht import reachable_maddrs
    from .dht_process import dht_result

    def ask() -> tuple[int, str, bytes]:
        """(the port asked, the initial peer that dialed back or "", its reply); raises where nobody could be asked."""
        port = next(int(Multiaddr(m).value_for_protocol("tcp")) for m in reachable_maddrs(dht) if "/tcp/" in m)
        call = functools.partial(_ask_first, initial=tuple(initial), port=port, timeout=timeout)
        via, reply = dht_result(dht, dht.run_coroutine(call, return_future=True), "a dial-back",
                                deadline=time.monotonic() + timeout * len(initial) + 5)  # fmt: skip
        return port, via, reply

    def run() -> None:
        # asked again while no initial peer answers: once, a lab's peers all went unasked (the bootstrap node did not
        # answer the first ask), and the peers behind NAT stayed full members that nobody could reach
        why = "no initial peer dialed back"
        for attempt in range(ASKS):
            if attempt:
                time.sleep(ASK_AGAIN_S)
            try:
                port, via, reply = ask()
            except Exception as e:  # noqa: BLE001 - the node is stopping, or nobody answered in time
                via, reply, why = "", b"", repr(e)[:200]
            if via:
                break
            why = reply.decode(errors="replace") if reply else why
        else:
            logger.info("reachability not checked (%s, %d times): this worker averages as a full member", why, ASKS)
            return
        reply, host = DialBackReply.FromString(reply), parse_peer_maddr(via).host
        check = reachability_verdict(reply, asked=[port], local_host=route_source(resolve_host(host)),
                                     via=f"initial peer {host}")  # fmt: skip
        (logger.info if check.status == "PASS" else logger.warning)("%s", check.line())
        if on_verdict is not None:
            on_verdict(check.status == "PASS", check.detail)

    threading.Thread(target=run, name="dial-back", daemon=True).start()
