"""A small network lab: one Linux network namespace per peer, joined by a bridge, every
link shaped with `tc tbf` in both directions (netem is not available on these machines).

    with NetLab(n_hosts=3, rate_mbit=10) as lab:
        proc = lab.popen(0, ["dilocox-peer", "join", "--host-maddrs", f"/ip4/{lab.ip(0)}/tcp/0", ...])

    with NetLab(n_hosts=4, rate_mbit=100, behind_nat=(2, 3)) as lab:   # hosts 2 and 3 at home, behind NAT
        lab.ip(2)          # 172.16.2.2: the address host 2 listens on, as a volunteer's machine would
        lab.public_ip(2)   # its router's address on the shared network, which every packet it sends comes from

A host behind NAT sits in a home network of its own behind a router namespace: MASQUERADE on
the router's public side, no port forwarding, and inbound connections dropped (only replies to
what the host opened pass), as a home router does. Its link is shaped on the home side.

Needs root and iproute2 (and iptables for NAT). Everything it creates is named `dlx<id>...` and
removed on exit, processes started in the namespaces included (their whole process group is killed). A SIGTERM to
the process (a stopped benchmark, a CI timeout) unwinds it through the `with` block, so that is an exit too; only a
SIGKILL leaves the lab behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

__all__ = ["NetLab", "NetLabError"]


class NetLabError(RuntimeError):
    pass


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise NetLabError(f"{' '.join(cmd)}: {result.stderr.strip() or result.stdout.strip()}")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)  # SystemExit unwinds the `with NetLab` blocks: each closes its lab


def _unwind_on_sigterm() -> Any:
    """Make SIGTERM raise SystemExit in this process while a lab is open; the handler it replaced, or None where the
    process set its own (it decides how to stop) or this is not the main thread (only it may set handlers)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return signal.SIG_DFL


def check_available(*, nat: bool = False) -> None:
    """Raise NetLabError naming what is missing (root, iproute2, and iptables for hosts behind NAT)."""
    if os.geteuid() != 0:
        raise NetLabError("network namespaces need root (run the netns tier as root)")
    for tool in ("ip", "tc", *(["iptables"] if nat else [])):
        if shutil.which(tool) is None:
            package = "iptables" if tool == "iptables" else "iproute2"
            raise NetLabError(f"`{tool}` not found: install {package} (apt-get install {package})")


class NetLab:
    def __init__(
        self, n_hosts: int, rate_mbit: float | None, *, subnet: int | None = None, behind_nat: tuple[int, ...] = ()
    ):
        check_available(nat=bool(behind_nat))
        self.id = uuid.uuid4().hex[:5]
        self.n_hosts, self.rate_mbit, self.behind_nat = n_hosts, rate_mbit, frozenset(behind_nat)
        self.subnet = subnet if subnet is not None else 100 + int(self.id, 16) % 100
        self.bridge = f"dlx{self.id}br"
        self.procs: list[subprocess.Popen] = []
        self._created_ns: list[str] = []
        self._forwarding = False
        self._sigterm_before: Any = None

    def ns(self, host: int) -> str:
        return f"dlx{self.id}h{host}"

    def ip(self, host: int) -> str:
        """The address `host` listens on: on the shared network, or in its home network when behind NAT."""
        return f"172.16.{host}.2" if host in self.behind_nat else self.public_ip(host)

    def public_ip(self, host: int) -> str:
        """Where `host`'s packets come from on the shared network (its router's, when behind NAT)."""
        return f"10.{self.subnet}.0.{host + 1}"

    def router(self, host: int) -> str:
        return f"dlx{self.id}r{host}"

    def __enter__(self) -> NetLab:
        self._sigterm_before = _unwind_on_sigterm()
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._allow_forwarding()
            _run("ip", "link", "set", self.bridge, "up")
            for host in range(self.n_hosts):
                self._add_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def _allow_forwarding(self) -> None:
        """Where dockerd runs, bridged frames pass iptables (br_netfilter) and its FORWARD policy is DROP:
        the lab's hosts could not reach each other. Accept what crosses this lab's bridge (undone in close)."""
        if shutil.which("iptables") is None:
            return
        for rule in self._forward_rules():
            _run("iptables", "-I", "FORWARD", *rule)
        self._forwarding = True

    def _forward_rules(self) -> list[list[str]]:
        return [["-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]]

    def _add_host(self, host: int) -> None:
        ns, outer, inner = self.ns(host), f"dlx{self.id}v{host}", f"dlx{self.id}p{host}"
        public = self.router(host) if host in self.behind_nat else ns  # what sits on the shared network
        for name in dict.fromkeys((ns, public)):
            _run("ip", "netns", "add", name)
            self._created_ns.append(name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", public)
        _run("ip", "link", "set", outer, "master", self.bridge, "up")
        _run("ip", "-n", public, "link", "set", inner, "name", "eth0")
        _run("ip", "-n", public, "addr", "add", f"{self.public_ip(host)}/24", "dev", "eth0")
        _run("ip", "-n", public, "link", "set", "eth0", "up")
        if public != ns:
            self._add_home(host, ns, public)
        if self.rate_mbit is not None:
            shape = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", "32kb", "latency", "400ms"]
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *shape)  # upload
            _run("tc", "qdisc", "add", "dev", outer, "root", *shape)  # download

    def _add_home(self, host: int, ns: str, router: str) -> None:
        """`host` in a home network (172.16.HOST.0/24) behind `router`: MASQUERADE out, nothing new in."""
        home, lan = f"dlx{self.id}h{host}e", f"dlx{self.id}l{host}"
        _run("ip", "link", "add", home, "type", "veth", "peer", "name", lan)
        _run("ip", "link", "set", home, "netns", ns)
        _run("ip", "link", "set", lan, "netns", router)
        _run("ip", "-n", ns, "link", "set", home, "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", f"172.16.{host}.1")
        _run("ip", "-n", router, "link", "set", lan, "name", "lan")
        _run("ip", "-n", router, "addr", "add", f"172.16.{host}.1/24", "dev", "lan")
        _run("ip", "-n", router, "link", "set", "lan", "up")
        _run("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        nat = ["ip", "netns", "exec", router, "iptables"]
        _run(*nat, "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        _run(*nat, "-A", "FORWARD", "-i", "eth0", "-o", "lan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
             "-j", "ACCEPT")  # fmt: skip
        _run(*nat, "-A", "FORWARD", "-i", "eth0", "-o", "lan", "-j", "DROP")

    def set_rate(self, host: int, rate_mbit: float) -> None:
        """Change host's link rate, both directions (a home link dropping to a crawl, and back)."""
        shape = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "32kb", "latency", "400ms"]
        verb = "change" if self.rate_mbit is not None else "replace"
        _run("ip", "netns", "exec", self.ns(host), "tc", "qdisc", verb, "dev", "eth0", "root", *shape)
        _run("tc", "qdisc", verb, "dev", f"dlx{self.id}v{host}", "root", *shape)

    def counters(self, host: int) -> tuple[int, int]:
        """(rx_bytes, tx_bytes) of host's eth0 since the lab started: what crossed its link, headers included.

        Read from the host side of its veth pair, whose counters mirror eth0's (a frame eth0 sends is one
        the host side receives), so no process enters the namespace and it can be polled cheaply."""
        stats = Path(f"/sys/class/net/dlx{self.id}v{host}/statistics")
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())

    def popen(self, host: int, cmd: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start `cmd` inside host's namespace, in its own process group."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *cmd], start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def start_bootstrap(self, host: int, state_dir: Path, *, relay: bool = False, port: int = 31337,
                        timeout: float = 60.0, env: dict[str, str] | None = None) -> str:  # fmt: skip
        """Start `dilocox-bootstrap` on `host` (its identity in `state_dir`, its output in state_dir/../NAME.out and
        .err), wait until it prints its multiaddr (it serves then), and return the multiaddr peers join with."""
        import sys
        import time

        from dilocox_p2p.bootstrap import load_node_identity
        from dilocox_p2p.identity import peer_id_of

        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        boot_id = peer_id_of(load_node_identity(state_dir / "identity.key"))
        out, err = state_dir.with_suffix(".out"), state_dir.with_suffix(".err")
        node = self.popen(host, [sys.executable, "-m", "dilocox_p2p.cli.bootstrap", "--state-dir", str(state_dir),
                                 *(["--relay"] if relay else []), "--host-maddrs", f"/ip4/0.0.0.0/tcp/{port}"],
                          stdout=open(out, "w"), stderr=open(err, "w"), env=None if env is None else {**os.environ, **env})  # fmt: skip
        deadline = time.monotonic() + timeout
        while not out.read_text().strip():  # its multiaddrs, printed once it serves
            if node.poll() is not None or time.monotonic() > deadline:
                raise NetLabError(f"the bootstrap node did not start:\n{err.read_text()[-3000:]}")
            time.sleep(0.2)
        return f"/ip4/{self.ip(host)}/tcp/{port}/p2p/{boot_id}"

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(30)
        for ns in self._created_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for host in range(self.n_hosts):
            subprocess.run(["ip", "link", "del", f"dlx{self.id}v{host}"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        if self._forwarding:
            for rule in self._forward_rules():
                subprocess.run(["iptables", "-D", "FORWARD", *rule], capture_output=True)
            self._forwarding = False
        if self._sigterm_before is not None:
            signal.signal(signal.SIGTERM, self._sigterm_before)
            self._sigterm_before = None

    def __exit__(self, *exc: Any) -> None:
        self.close()
