"""The churn soak's run (benchmarks/soak.py): the peers' processes and the seeded chaos fired at them.

Soak starts the peers (`dilocox_p2p.cli join`, each in its own process group, or in a network namespace of
benchmarks/netlab.py), follows the swarm's round from the peers' records, fires the scheduled events (kill,
join, freeze, throttle) one at a time and undoes them, restarts a peer that found no initial peer as a
supervisor would, and stops every peer at the end. Event and SoakPeer record what happened, for
benchmarks/soak_check.py to judge; schedule draws the events from --seed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS", "MAX_RETRIES", "SETTLE_ROUNDS", "SWARM_FLAGS", "Event", "Soak", "SoakPeer",
    "read_records", "schedule", "sync_rounds_per_round",
]  # fmt: skip

KINDS = ("kill", "join", "freeze", "throttle")
MAX_RETRIES = 2  # starts of one peer that may exit 75 (no initial peer answered) before it counts as a crash
SETTLE_ROUNDS = 8  # no event fires in the run's last rounds: a restarted peer needs that long to be back and judged
SWARM_FLAGS = [
    "--round-wait", "10", "--set", "swarm.chunk_timeout=5.0", "--set", "swarm.allreduce_timeout=30.0",
    "--set", "inner.threads=1",
]  # fmt: skip


@dataclass
class Event:
    round: int  # the swarm round that triggers it
    kind: str
    peer: int | None = None  # chosen when it fires (a live peer); join: the new peer's index
    time: float | None = None  # seconds since the soak started
    fired_round: int | None = None
    done_time: float | None = None  # restart / thaw / restore
    skipped: bool = False  # its turn came within the last SETTLE_ROUNDS rounds (events run one at a time)


@dataclass
class SoakPeer:
    index: int
    run_dir: Path
    cmd: list[str]
    proc: subprocess.Popen | None = None
    log: Any = None
    kills: list[dict] = field(default_factory=list)  # {time, last_round, restart_time}
    retries: int = 0  # exits with 75 (no initial peer answered), restarted as a supervisor would
    frozen_until: float | None = None
    joined_at: float = 0.0
    life_start: float = 0.0  # wall time of its latest start


class Soak:
    def __init__(self, args: argparse.Namespace, root: Path, *, chaos: bool):
        self.args, self.root, self.chaos = args, root, chaos
        self.rng = random.Random(args.seed)
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self.syncs = sync_rounds_per_round(args.extra)  # records count sync rounds (rounds x fragments)
        self.peers: list[SoakPeer] = []
        self.events = schedule(args, self.rng) if chaos else []
        self.lab = None
        self.first_maddr = ""  # peer 0's full multiaddr (listen_maddr)
        self.pending: list[tuple[float, str, int]] = []  # (due time, action, peer)

    # ----- processes -----------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def start_peer(self, index: int, *, resume: bool | str = False) -> SoakPeer:
        if index < len(self.peers):
            peer = self.peers[index]
        else:
            run_dir = self.root / f"peer{index}"
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", self.args.run_id, "--run-dir", str(run_dir),
                "--preset", "tiny", "--stages", str(self.args.stages), "--rounds", str(self.args.rounds),
                "--inner-steps", str(self.args.inner_steps), "--device", "cpu", "--progress", "lines",
                "--data-seed", str(index), "--host-maddrs", self.listen_maddr(index, run_dir), *SWARM_FLAGS,
                *self.args.extra,
            ]  # fmt: skip
            peer = SoakPeer(index, run_dir, cmd, joined_at=self.now())
            self.peers.append(peer)
            if index < self.args.peers:  # the first peers start round 0 together; joiners and restarts never wait
                peer.log = open(peer.run_dir.parent / f"peer{index}.out", "a")
                return self._spawn(peer, cmd + ["--min-peers", str(self.args.peers)])
        peer.log = open(peer.run_dir.parent / f"peer{index}.out", "a")
        return self._spawn(peer, peer.cmd + (["--resume"] if resume is True else ["--resume", resume] if resume else []))

    def _spawn(self, peer: SoakPeer, cmd: list[str]) -> SoakPeer:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        peer.life_start = time.time()
        if peer.index > 0 or peer.kills or peer.retries:  # the first start of peer 0 starts the swarm; every
            cmd = [*cmd, "--initial-peers", *self.initial()]  # other start joins it through live peers
        if self.lab is not None:
            peer.proc = self.lab.popen(peer.index, cmd, stdout=peer.log, stderr=subprocess.STDOUT, env=env)
        else:
            peer.proc = subprocess.Popen(cmd, stdout=peer.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        return peer

    def listen_maddr(self, index: int, run_dir: Path) -> str:
        """Where peer `index` listens. Peer 0 starts the swarm at an address known before it runs (a free port, a
        worker key made here), so that the first peers all start at once; the others take any port."""
        if index > 0:
            return f"/ip4/{self.host_ip(index)}/tcp/0"
        from dilocox_p2p.endpoints import free_ports
        from dilocox_p2p.identity import peer_id_of, worker_identity

        port = 31337 if self.lab is not None else free_ports(self.host_ip(0), self.args.stages)
        key = worker_identity(run_dir / "identity" / "stage0.ed25519")
        self.first_maddr = f"/ip4/{self.host_ip(0)}/tcp/{port}/p2p/{peer_id_of(key)}"
        return f"/ip4/{self.host_ip(0)}/tcp/{port}"

    def host_ip(self, index: int) -> str:
        return self.lab.ip(index) if self.lab is not None else "127.0.0.1"

    def initial(self) -> list[str]:
        """--initial-peers for a peer that starts now: the first multiaddr of up to three live peers, as an
        operator lists several bootstrap nodes (peer 0's is known before it listens: a joiner joins the moment it
        does)."""
        found = [self.first_maddr] if self.alive(self.peers[0]) else []
        for peer in self.peers[1:]:
            path = peer.run_dir / "multiaddrs.txt"
            if len(found) < 3 and self.alive(peer) and peer.frozen_until is None and path.exists():
                found += path.read_text().split()[:1]
        return found

    def alive(self, peer: SoakPeer) -> bool:
        return peer.proc is not None and peer.proc.poll() is None

    def signal_group(self, peer: SoakPeer, signum: int) -> None:
        try:
            os.killpg(peer.proc.pid, signum)
        except ProcessLookupError:
            pass

    # ----- chaos ---------------------------------------------------------------------------------
    def swarm_round(self) -> int:
        """The swarm's progress: the last round recorded by the median live peer (a peer racing ahead on its own
        does not move it)."""
        ends = sorted(max((r["round"] + 1 for r in read_records(p.run_dir)), default=0) for p in self.candidates())
        return ends[len(ends) // 2] if ends else 0

    def fire_due(self) -> None:
        current = self.swarm_round()
        for event in self.events:
            if event.time is None and not event.skipped and current >= event.round and not self.pending:
                if current >= self.args.rounds * self.syncs - SETTLE_ROUNDS:
                    event.skipped = True
                    print(f"[soak] {self.now():7.1f}s round {current}: {event.kind} skipped (too late to settle)")
                    continue
                self.fire(event, current)
                return  # one event at a time: the next waits for this one to be undone
        now = self.now()
        for due, action, index in list(self.pending):
            if now >= due:
                self.pending.remove((due, action, index))
                self.undo(action, index)

    def candidates(self) -> list[SoakPeer]:
        """Live, unfrozen peers that trained since they (re)started: any may be hit (joiners learn the others from
        the DHT, not only peer 0). A peer still starting is not: frozen or killed before it is back, its return
        would slip past the run's end, where nothing can judge it."""
        return [p for p in self.peers if self.alive(p) and p.frozen_until is None and self.trained_in_this_life(p)]

    def trained_in_this_life(self, peer: SoakPeer) -> bool:
        return any(r.get("time", 0) >= peer.life_start for r in read_records(peer.run_dir))

    def fire(self, event: Event, current: int) -> None:
        event.time, event.fired_round = round(self.now(), 2), current
        if event.kind == "join":
            event.peer = len(self.peers)
            self.start_peer(event.peer)
            event.done_time = event.time
        else:
            live = self.candidates()
            if len(live) < 3:  # keep a quorum: never churn a pair down to one
                event.kind = "join"
                return self.fire(event, current)
            peer = self.rng.choice(live)
            event.peer = peer.index
            if event.kind == "kill":
                last = max((r["round"] for r in read_records(peer.run_dir)), default=-1)
                peer.kills.append({"time": event.time, "last_round": last})
                self.signal_group(peer, signal.SIGKILL)
                peer.proc.wait(30)
                self.pending.append((self.now() + self.args.down, "restart", peer.index))
            elif event.kind == "freeze":
                self.signal_group(peer, signal.SIGSTOP)
                peer.frozen_until = self.now() + self.args.freeze
                self.pending.append((peer.frozen_until, "thaw", peer.index))
            elif event.kind == "throttle":
                self.lab.set_rate(peer.index, self.args.throttle_mbit)
                self.pending.append((self.now() + self.args.freeze, "restore", peer.index))
        print(f"[soak] {event.time:7.1f}s round {current}: {event.kind} peer{event.peer}", flush=True)

    def undo(self, action: str, index: int) -> None:
        peer = self.peers[index]
        if action == "retry":
            self.start_peer(index, resume="auto")
            return
        event = next(e for e in reversed(self.events) if e.peer == index and e.time is not None)
        event.done_time = round(self.now(), 2)
        if action == "restart":
            peer.kills[-1]["restart_time"] = event.done_time
            peer.kills[-1]["restart_round"] = self.swarm_round()
            self.start_peer(index, resume=True)
        elif action == "thaw":
            self.signal_group(peer, signal.SIGCONT)
            peer.frozen_until = None
        elif action == "restore":
            self.lab.set_rate(index, self.args.rate)
        print(f"[soak] {event.done_time:7.1f}s {action} peer{index}", flush=True)

    def supervise(self) -> None:
        """Restart, --down seconds later, a peer that exited 75 (no initial peer answered at start: temporary,
        the exit code services restart on), with --resume as its unit would."""
        for peer in self.peers:
            code = peer.proc.poll() if peer.proc is not None else None
            if code == 75 and not any(i == peer.index for _, _, i in self.pending) and self.candidates():
                peer.retries += 1
                print(f"[soak] {self.now():7.1f}s peer{peer.index} exited 75 (swarm unreachable): restarting", flush=True)
                peer.proc = None
                self.pending.append((self.now() + self.args.down, "retry", peer.index))

    # ----- the run -----------------------------------------------------------------------------------
    def run(self) -> None:
        for index in range(self.args.peers):
            self.start_peer(index)
        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            self.fire_due()
            self.supervise()
            if not self.pending and all(not self.alive(p) for p in self.peers):  # the run is over
                for event in self.events:
                    event.skipped = event.skipped or event.time is None
                return
            time.sleep(0.5)
        raise SystemExit(f"soak did not finish within {self.args.timeout}s")

    def stop_all(self) -> None:
        for peer in self.peers:
            if self.alive(peer):
                self.signal_group(peer, signal.SIGCONT)
                self.signal_group(peer, signal.SIGKILL)
                peer.proc.wait(30)
            if peer.log is not None:
                peer.log.close()


def sync_rounds_per_round(extra: list[str]) -> int:
    """Sync rounds per outer round for peers started with the `join` flags `extra` (streaming: its fragments)."""
    from dilocox_p2p.cli.__main__ import build_parser
    from dilocox_p2p.cli.options import config_from_args

    return config_from_args(build_parser().parse_args(["join", *extra])).outer.syncs_per_round


def schedule(args: argparse.Namespace, rng: random.Random) -> list[Event]:
    """`args.events` events at rounds spread over the run's middle, every kind used at least once."""
    kinds = [k for k in KINDS if k != "throttle" or args.netns]
    picks = (kinds * (args.events // len(kinds) + 1))[: args.events]
    if args.events > len(kinds):
        picks = kinds + [rng.choice(kinds) for _ in range(args.events - len(kinds))]
    rng.shuffle(picks)
    first, last = 2, max(3, args.rounds - 2 * SETTLE_ROUNDS)  # events run one at a time: leave room to settle
    rounds = sorted(rng.randint(first, last) for _ in picks)
    return [Event(round=r, kind=k) for r, k in zip(rounds, picks)]


def read_records(run_dir: Path) -> list[dict]:
    from dilocox_p2p.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")
