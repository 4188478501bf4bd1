"""The configuration of how a peer meets the others and is watched: the [swarm] and [control] sections
(config.py holds the whole Config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config_checks import check_choices, check_maddr, fail

__all__ = ["ControlConfig", "SwarmConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmConfig:
    enabled: bool = True
    """Join (or start) a swarm; false trains alone without a DHT (a baseline for benchmarks)."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of live peers or bootstrap nodes; empty starts a new swarm."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Where each stage worker's DHT listens; tcp/0 picks a free port per stage."""
    announce_maddrs: tuple[str, ...] = ()
    """Addresses other machines should use to reach this peer (public IP, NAT mapping)."""
    auto_relay: bool = False
    """Behind a NAT that cannot forward a port: become reachable through relays (bootstrap nodes started with
    `--relay`) among the initial peers. Slower than a direct link: forward the port when you can."""
    reachability: Literal["auto", "public", "client"] = "auto"
    """How each stage worker averages where other machines may not reach it. auto: a worker that listens beyond
    loopback and has initial peers asks the swarm to dial it back when it starts; found unreachable (behind a NAT
    without a forwarded port), it averages as a **client member**: it sends its parts to the others and takes the
    average over connections it opens itself, reduces no span and never leads a group, so that no member needs a
    connection to it. public: always a full member. client: always a client member (`status` shows which)."""
    min_group_size: int = 2
    """Fewest peers an all-reduce may run with; a worker that finds no such group takes the average its
    stage group computed without it, or (if there is none) its own pseudo-gradient."""
    min_peers: int = 1
    """Wait before the first round until this many peers (this one included) are in the run."""
    peer_wait: float = 600.0
    """Most seconds to wait for min_peers; after that, training starts with those present."""
    round_wait: float = 30.0
    """Most seconds a fast peer waits for slower ones to form a round's group (then averages without them)."""
    reuse_groups: bool = True
    """The members of a round's group that averaged whole form the next round's group again themselves, without
    matchmaking, when all of them start it (swarm/group_reuse.py; about 0.2 s less per exchange on the 100 Mbit/s
    lab); false: every round's group is found by matchmaking. Peers may differ: one that does not reuse joins a
    reused group when its parts reach it."""
    allreduce_timeout: float = 60.0
    """Most seconds one all-reduce may take once its group is formed (with `deadlines = "learned"`: where this
    stage's deadline starts, and what deadline_floor and deadline_ceiling are shares of)."""
    chunk_timeout: float = 10.0
    """A peer that sends no data for this long during an all-reduce is dropped from it (learned deadlines scale it
    with the all-reduce's: keep it well below half of allreduce_timeout, so that a silent member is dropped before
    the all-reduce's deadline, which a live but slow link alone should reach)."""
    state_timeout: float = 60.0
    """Most seconds a state download (late join, repair) may take (learned: where this stage's deadline starts)."""
    deadlines: Literal["learned", "fixed"] = "learned"
    """learned: the all-reduce, chunk and state deadlines follow what this peer's recent exchanges and state downloads
    took (4x their 90th percentile), and grow (2x) after one ran out while still moving, within deadline_floor and
    deadline_ceiling times the configured ones (swarm/deadlines.py; `deadlines` in metrics.jsonl); fixed: the
    configured ones, always."""
    deadline_floor: float = 1.0
    """Learned deadlines: the lowest share of each configured deadline they may go down to. 1 (default): never below
    it (a slow link still gets longer ones). Below 1, a fast swarm waits less after a failure, but a member merely
    slow for a moment (a busy machine) may be cut off."""
    deadline_ceiling: float = 8.0
    """Learned deadlines: the most times each configured deadline they may grow to."""
    state_donors: int = 8
    """Most donors a state download takes pieces from at once (each piece checked against the majority's hash on
    arrival; the state has up to 8 pieces); 1: the whole state from one donor."""
    helper_nice: int = 0
    """CPU priority of the swarm's helper processes (DHT, p2p daemon, averager) against training, in nice
    levels. 0 (default): equal, so neither can starve the other (benchmarks/overlap.py: 0.97x of training
    without averaging). Positive: the helpers run that many levels below training and take only the CPU it
    leaves idle (about as fast where cores are to spare; on a CPU-bound machine starved helpers can miss the
    all-reduce timeouts). Negative: training runs below the helpers (measured slower: helper wake-ups
    preempt pipeline stages)."""
    settled_nice: int = 10
    """Nice levels by which each stage lowers itself and its helpers once it trains (its first round's average
    applied), so that a peer starting or restarting on the same machine takes the CPU first (beside 5 busy
    peers on 2 cores: see README, Start-up). Changes nothing where cores are idle; 0 keeps the priority."""
    identity: str = ""
    """This peer's Ed25519 key file (`dilocox-peer keygen`); empty: a key made in the run directory and kept."""
    admission: Literal["open", "closed"] = "open"
    """open: any peer with a signed identity and this config; closed: only keys on `allowlist` or holding a
    certificate from the run key (`dilocox-peer certify`)."""
    allowlist: tuple[str, ...] = ()
    """Closed runs: peer public keys (hex, as `dilocox-peer keygen` prints them) admitted without a certificate."""
    run_key: str = ""
    """Closed runs: the run key's public key (hex); peers holding a certificate it signed are admitted."""
    certificate: str = ""
    """Closed runs: this peer's certificate file from `dilocox-peer certify`."""
    max_norm_ratio: float = 10.0
    """A contribution whose norm exceeds this many times the group's median is left out of the average."""
    direction_screen: bool = True
    """With three or more contributions, one whose dot product with the group's coordinate-wise median is negative is
    left out of the average, unstruck (average.against_the_group): a sign flip under max_norm_ratio, which the clip
    still let pull the mean back (3 honest `tiny` peers beside one such: +9.5% val loss after 10 rounds; with the
    screen the same as the 3 alone). Low-rank's factors P and Q' too (they share the Q and basis every member
    holds). Cost with honest peers only: docs/benchmarks.md section 7."""
    clip_ratio: float = 1.5
    """A contribution whose norm exceeds this many times the group's lower median is scaled down to it before it is
    averaged (bounded influence: a sign flip below max_norm_ratio weighs at most this many honest contributions, and
    at 1.5 no longer turns a group of 3's mean around); 0 scales none. Honest peers were never clipped at 1.5 (4
    `tiny` peers, 30 rounds, fp32 and int8: the same curves to the bit, docs/benchmarks.md section 7). Every member
    of a run must agree on it (the config hash covers it)."""
    ban_after: int = 3
    """Strikes (refused contributions or messages) after which a peer is banned for the rest of the run."""

    def __post_init__(self) -> None:
        check_choices(self, "swarm")
        if self.min_group_size < 1:
            fail("swarm.min_group_size", self.min_group_size, "must be at least 1")
        if self.min_peers < 1:
            fail("swarm.min_peers", self.min_peers, "must be at least 1")
        if not -19 <= self.helper_nice <= 19:
            fail("swarm.helper_nice", self.helper_nice, "must be -19..19 (nice levels)")
        if not 0 <= self.settled_nice <= 19:
            fail("swarm.settled_nice", self.settled_nice, "must be 0..19 (nice levels; a peer can only lower itself)")
        if not 0 < self.deadline_floor <= 1:
            fail("swarm.deadline_floor", self.deadline_floor, "must be within (0, 1] (a share of each configured deadline)")
        if self.deadline_ceiling < 1:
            fail("swarm.deadline_ceiling", self.deadline_ceiling, "must be at least 1 (times each configured deadline)")
        if self.state_donors < 1:
            fail("swarm.state_donors", self.state_donors, "must be at least 1 (1: the whole state from one donor)")
        for name in ("peer_wait", "round_wait", "allreduce_timeout", "chunk_timeout", "state_timeout"):
            if getattr(self, name) <= 0:
                fail(f"swarm.{name}", getattr(self, name), "must be positive (seconds)")
        if not self.host_maddrs:
            fail("swarm.host_maddrs", self.host_maddrs, "needs at least one listen address")
        for key in (*self.allowlist, *([self.run_key] if self.run_key else [])):
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                fail("swarm.allowlist" if key in self.allowlist else "swarm.run_key", key,
                      "must be an Ed25519 public key in 64 lowercase hex digits (as `dilocox-peer keygen` prints it)")
        if self.admission == "closed" and not (self.allowlist or self.run_key):
            fail("swarm.admission", self.admission, "a closed run needs swarm.allowlist or swarm.run_key")
        if self.max_norm_ratio <= 1:
            fail("swarm.max_norm_ratio", self.max_norm_ratio, "must be above 1 (times the group's median norm)")
        if self.clip_ratio != 0 and not 1 <= self.clip_ratio <= self.max_norm_ratio:
            fail("swarm.clip_ratio", self.clip_ratio, f"must be 0 (off) or within [1, max_norm_ratio = {self.max_norm_ratio}]")
        if self.ban_after < 1:
            fail("swarm.ban_after", self.ban_after, "must be at least 1 strike")
        for name in ("initial_peers", "host_maddrs", "announce_maddrs") if self.enabled else ():  # unused alone
            for text in getattr(self, name):
                check_maddr(f"swarm.{name}", text, need_peer_id=name == "initial_peers")


@dataclass(frozen=True, kw_only=True, slots=True)
class ControlConfig:
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    """Progress display: auto = a bar on a terminal, one line per round otherwise."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    """text: one readable line per event; json: one JSON object per line (time, level, peer, stage, round...)."""
    control_addr: str = "127.0.0.1:0"
    """Where stage 0 serves the PeerControl gRPC service and gRPC health (`dilocox-peer status`); port 0 picks a
    free port. The bound address is written to RUN_DIR/control.addr. Requests from this machine are served as
    they come; from other hosts only those signed by one of `operator_keys` (control_auth.py)."""
    operator_keys: tuple[str, ...] = ()
    """Ed25519 public keys (hex, as `dilocox-peer keygen` prints them) whose signed requests the control plane
    serves from other hosts (`dilocox-peer status --target HOST:PORT --operator-key FILE`); empty: loopback only."""
    metrics_addr: str = ""
    """Where stage 0 serves Prometheus metrics at /metrics (HOST:PORT); empty: not served. Unauthenticated (a
    scraper cannot sign): bind it to loopback or a monitoring network, apart from `control_addr`."""

    def __post_init__(self) -> None:
        check_choices(self, "control")
        from .endpoints import parse_hostport

        parse_hostport(self.control_addr, flag="control.control_addr")
        from .control_auth import operator_keys_from_hex
        from .errors import ConfigError

        try:
            operator_keys_from_hex(self.operator_keys, flag="control.operator_keys")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.metrics_addr:
            parse_hostport(self.metrics_addr, flag="control.metrics_addr")
