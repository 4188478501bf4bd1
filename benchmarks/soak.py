"""Churn soak: many peers, many rounds, seeded chaos; the swarm must stay in agreement and keep learning.

    python benchmarks/soak.py                                  # 6 peers x 2 stages, 50 rounds, 12 events
    python benchmarks/soak.py --peers 4 --rounds 26 --events 3 # the short soak (tests/swarm/test_soak.py)
    sudo python benchmarks/soak.py --netns                     # peers in network namespaces, + link throttling
    python benchmarks/soak.py --baseline                       # also a churn-free run of the same peers

Chaos, drawn from --seed and triggered when the swarm reaches a round:
    kill     SIGKILL of a peer's whole process group (launcher, stages, DHT, p2pd), restarted with --resume
             after --down seconds
    join     a brand-new peer (its own run dir and data seed) joins the running swarm
    freeze   SIGSTOP of a peer's process group for --freeze seconds (longer than the swarm's timeouts), SIGCONT
    throttle (--netns) one peer's link drops to --throttle-mbit for --freeze seconds, then is restored

Invariants, checked from every peer's metrics.jsonl and logs (`check`):
    group        peers that applied the average of one group (the record's `groups`) and held one state before
                 it hold one state after it: a group never splits (exchange.py, phase 5)
    agreement    at every round, a peer whose stage hash differs from the majority of the peers that completed
                 that round (most holders; a tie goes to the smallest peer id, as the swarm's hash checks decide)
                 is back on the majority's hash one round later: the hash check that finds it runs during the
                 next round, so it trains one round on a diverged state, never two
    resumption   a killed peer resumes from its last checkpoint ("resumed from round k", k >= the last round it
                 recorded) and is back in a group of >= 2 within --rejoin-rounds swarm rounds of resuming (its
                 process start-up, reported as `seconds_to_resume`, is the machine's, not the swarm's); a restart
                 killed again before it was back is superseded by the next one. `restart_to_group_s`: seconds
                 from the restart to the end of its first exchange in a group (its start-up marks)
    crashes      every peer process exits 0, except the ones the soak killed; a start that found no initial peer
                 (exit 75, temporary) is restarted as a supervisor would, at most MAX_RETRIES times
    leftovers    no process whose command line names the soak's directory survives the soak
    learning     the final val loss is below the initial one, and the last quarter's mean below the first's

Results: benchmarks/results/NAME.json (events, repairs, rounds lost per peer, seconds to rejoin, bytes,
final val loss beside the churn-free run's) and NAME.png (one row per peer: what it did each round).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from dilocox_p2p.swarm.agreement import majority_hash  # noqa: E402

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


# ----- reading what happened --------------------------------------------------------------------------
def read_records(run_dir: Path) -> list[dict]:
    from dilocox_p2p.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def check(soak: Soak) -> dict[str, Any]:
    """The invariants (module docstring) as {name: list of violations}, and the figures of the report."""
    records = {p.index: {r["round"]: r for r in read_records(p.run_dir)} for p in soak.peers}
    violations: dict[str, list[str]] = {"group": [], "agreement": [], "resumption": [], "crashes": [], "learning": []}
    ids = {(p.index, s): worker_peer_id(p.run_dir, s) for p in soak.peers for s in range(soak.args.stages)}
    for stage in range(soak.args.stages):
        violations["group"] += group_splits(records, stage)
        violations["agreement"] += minority_streaks(records, stage, {i: ids[(i, stage)] for i in records})
    for peer in soak.peers:
        violations["resumption"] += check_rejoins(soak, peer, records)
        if peer.proc is not None and peer.proc.returncode not in (0, None):
            violations["crashes"].append(f"peer{peer.index} exited {peer.proc.returncode}")
        if peer.retries > MAX_RETRIES:
            violations["crashes"].append(f"peer{peer.index} could not reach the swarm at {peer.retries} starts")
    vals = [r["val_loss"] for t, r in sorted(records[reference_peer(soak, records)].items())]
    quarter = max(1, len(vals) // 4)
    initial = json.loads((soak.peers[0].run_dir / "run.json").read_text())["initial_val_loss"]
    if not (vals and vals[-1] < initial and sum(vals[-quarter:]) < sum(vals[:quarter])):
        violations["learning"].append(f"val loss {initial:.3f} -> {vals[-1] if vals else None}")
    return {"violations": violations, "records": records}


def reference_peer(soak: Soak, records: dict[int, dict[int, dict]]) -> int:
    """The peer whose curve stands for the swarm's: the first of those holding the majority's state at the last
    round recorded by most (with a tie, the smallest peer id's), among the peers that recorded it."""
    last = max(t for recs in records.values() for t in recs)
    here = {i: recs[last] for i, recs in records.items() if last in recs}
    ids = {i: ":".join(worker_peer_id(soak.peers[i].run_dir, s) for s in range(soak.args.stages)) for i in here}
    majority = majority_hash({ids[i]: "|".join(r["stage_hashes"]) for i, r in here.items()})
    return min(i for i, r in here.items() if "|".join(r["stage_hashes"]) == majority)


def final_val_loss(soak: Soak, records: dict[int, dict[int, dict]]) -> float | None:
    if not any(records.values()):
        return None
    recs = records[reference_peer(soak, records)]
    return recs[max(recs)]["val_loss"]


def group_splits(records: dict[int, dict[int, dict]], stage: int) -> list[str]:
    """Rounds where two peers that held one state applied one group's average and then held different ones."""
    found = []
    for t in sorted({t for recs in records.values() for t in recs}):
        members: dict[tuple[str, str], dict[int, str]] = {}  # (group, hash before) -> {peer: hash after}
        for i, recs in records.items():
            r, before = recs.get(t), recs.get(t - 1)
            if r is None or before is None or not r.get("groups") or r["groups"][stage] is None or r["replaced_stages"]:
                continue
            members.setdefault((r["groups"][stage], before["stage_hashes"][stage]), {})[i] = r["stage_hashes"][stage]
        for (group, _), after in members.items():
            if len(set(after.values())) > 1:
                camps = ", ".join(f"peer{i} {h[:8]}" for i, h in sorted(after.items()))
                found.append(f"stage {stage} round {t}: group {group[:8]} split ({camps})")
    return found


def minority_streaks(records: dict[int, dict[int, dict]], stage: int, ids: dict[int, str]) -> list[str]:
    """Peers holding a minority hash at two rounds running (the majority as the swarm's hash checks define
    it: most holders, a tie to the smallest peer id)."""
    found, diverged = [], {}  # peer -> last round it held a minority hash
    for t in sorted({t for recs in records.values() for t in recs}):
        here = {i: recs[t] for i, recs in records.items() if t in recs}
        majority = majority_hash({ids[i]: r["stage_hashes"][stage] for i, r in here.items()})
        for i, r in here.items():
            if r["stage_hashes"][stage] != majority:
                if diverged.get(i) == t - 1:
                    found.append(f"peer{i} stage {stage}: minority hash at rounds {t - 1} and {t}")
                diverged[i] = t
    return found


def check_rejoins(soak: Soak, peer: SoakPeer, records: dict[int, dict[int, dict]]) -> list[str]:
    """Each restart of `peer` resumed from its last checkpoint and was back in a group within --rejoin-rounds
    swarm rounds of resuming; fills in each kill's figures (seconds to resume and to rejoin, rounds)."""
    found, resumed = [], resumptions(peer.run_dir)
    mine = records[peer.index]
    for n, kill in enumerate(peer.kills):
        restart = soak.t0_wall + kill.get("restart_time", float("inf"))
        after = [(when, k) for when, k in resumed if when >= restart - 1.0]  # log times have whole seconds
        if n + 1 < len(peer.kills) and (not after or after[0][0] > soak.t0_wall + peer.kills[n + 1]["time"]):
            kill["superseded"] = True  # killed again while starting: the next restart is the one to judge
            continue
        if not after:
            found.append(f"peer{peer.index}: restart {n} never resumed (kill at round {kill['last_round']})")
            continue
        when, k = after[0]
        kill["resumed_from_round"], kill["seconds_to_resume"] = k, round(when - restart, 1)
        if k < kill["last_round"]:  # checkpoint k starts round k: the last round recorded is at most lost
            found.append(f"peer{peer.index}: kill {n} at round {kill['last_round']}, resumed from round {k}")
        back = sorted(t for t, r in mine.items() if r["time"] > when and (r.get("group_size") or 0) >= 2)
        swarm_round = 1 + max((t for recs in records.values() for t, r in recs.items() if r["time"] <= when), default=-1)
        kill["resumed_at_swarm_round"], kill["back_round"] = swarm_round, back[0] if back else None
        kill["seconds_to_rejoin"] = round(mine[back[0]]["time"] - when, 1) if back else None
        kill["restart_to_group_s"] = restart_to_group(peer.run_dir, restart)
        if n + 1 < len(peer.kills) and (not back or mine[back[0]]["time"] > soak.t0_wall + peer.kills[n + 1]["time"]):
            kill["superseded"] = True  # killed again before it was back: the next restart is the one to judge
        elif not back or back[0] - swarm_round > soak.args.rejoin_rounds:
            found.append(f"peer{peer.index}: not back in a group within {soak.args.rejoin_rounds} rounds of resuming "
                         f"(restart {n}: resumed at swarm round {swarm_round}, back at {kill['back_round']})")  # fmt: skip
    return found


def restart_to_group(run_dir: Path, restart: float) -> float | None:
    """Seconds from a restart (a Unix time) to the end of the restarted peer's first exchange in a group of two
    or more: its start-up marks (RUN_DIR/startup.jsonl), the life that began at the restart."""
    from dilocox_p2p.startup import read_lives

    for life in read_lives(run_dir):
        if life[0]["phase"] == "process" and life[0]["time"] >= restart - 1.0:
            grouped = [m["time"] for m in life if m["phase"] == "first_group" and m["stage"] == 0]
            return round(grouped[0] - life[0]["time"], 1) if grouped else None
    return None


def resumptions(run_dir: Path) -> list[tuple[float, int]]:
    """(unix time, round) of every "resumed from round k" line of stage 0's log."""
    path = run_dir / "logs" / "stage0.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return [
        (time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")), int(k))
        for stamp, k in re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) .*resumed from round (\d+)", text, re.M)
    ]


def worker_peer_id(run_dir: Path, stage: int) -> str:
    """The libp2p peer id of a peer's stage worker (its key file in RUN_DIR/identity/)."""
    from dilocox_p2p.identity import peer_id_of, worker_identity

    path = run_dir / "identity" / f"stage{stage}.ed25519"
    return peer_id_of(worker_identity(path)) if path.exists() else f"~{run_dir.name}"


def leftovers(root: Path) -> list[str]:
    """Processes whose command line names the soak's directory (p2pd's names its identity file there)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(root) in cmdline:
                found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def summarize(soak: Soak, checked: dict[str, Any]) -> dict[str, Any]:
    records = checked["records"]
    peers = {}
    for peer in soak.peers:
        recs = records[peer.index]
        trained = {t for t, r in recs.items() if r.get("dropped_round") is None}
        first = min(recs, default=0)
        peers[f"peer{peer.index}"] = {
            "joined_at_s": round(peer.joined_at, 1),
            "rounds_recorded": len(recs),
            "rounds_lost": len(set(range(first, soak.args.rounds * soak.syncs)) - trained),
            "repairs": sum(r["faults"].get("repairs", 0) for r in recs.values()),
            "catch_ups": sum(r["faults"].get("catch_ups", 0) for r in recs.values()),
            "averages_adopted": sum(r["faults"].get("averages_adopted", 0) for r in recs.values()),
            "retries": peer.retries,
            "bytes_sent": sum(r["bytes_sent"] for r in recs.values()),
            "bytes_received": sum(r["bytes_received"] for r in recs.values()),
            "kills": peer.kills,
            "final_val_loss": recs[max(recs)]["val_loss"] if recs else None,
        }
    return {"events": [asdict(e) for e in soak.events], "peers": peers,
            "final_val_loss": final_val_loss(soak, records)}  # fmt: skip


def timeline(soak: Soak, checked: dict[str, Any], path: Path, baseline_loss: float | None) -> None:
    """One row per peer: what it did each round (averaged, alone, repaired, dropped, absent), events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"group": "#4c9a2a", "first round": "#a6d68f", "alone": "#e0b000", "repaired": "#d05a00",
              "dropped": "#c00000", "absent": "#dddddd"}  # fmt: skip
    records, n_rounds = checked["records"], soak.args.rounds * soak.syncs
    fig, (ax, loss_ax) = plt.subplots(2, 1, figsize=(12, 1.2 + 0.45 * len(soak.peers) + 3), height_ratios=[len(soak.peers), 4])
    for row, peer in enumerate(soak.peers):
        for t in range(n_rounds):
            r = records[peer.index].get(t)
            state = ("absent" if r is None else "dropped" if r.get("dropped_round") is not None
                     else "repaired" if r.get("replaced_stages") else "first round" if r.get("group_size") is None
                     else "group" if r["group_size"] >= 2 else "alone")  # fmt: skip
            ax.add_patch(plt.Rectangle((t, row - 0.4), 1, 0.8, color=colors[state], lw=0))
    for e in soak.events:
        if e.time is not None and e.peer is not None:
            ax.annotate(e.kind, (e.fired_round, e.peer), fontsize=7, ha="center", va="center", color="black",
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "alpha": 0.8})  # fmt: skip
    ax.set_xlim(0, n_rounds)
    ax.set_ylim(-0.6, len(soak.peers) - 0.4)
    ax.set_yticks(range(len(soak.peers)), [f"peer{p.index}" for p in soak.peers])
    ax.set_xlabel("round")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], ncol=6, loc="upper center",
              bbox_to_anchor=(0.5, 1.25), fontsize=8)  # fmt: skip
    for peer in soak.peers:
        recs = sorted(records[peer.index].items())
        loss_ax.plot([t for t, _ in recs], [r["val_loss"] for _, r in recs], lw=1, label=f"peer{peer.index}")
    if baseline_loss is not None:
        loss_ax.axhline(baseline_loss, ls="--", color="gray", label="churn-free final")
    loss_ax.set_xlabel("round")
    loss_ax.set_ylabel("val loss (theta_g)")
    loss_ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_soak(args: argparse.Namespace, root: Path, *, chaos: bool) -> tuple[Soak, dict[str, Any]]:
    soak = Soak(args, root, chaos=chaos)
    if args.netns:
        from benchmarks.netlab import NetLab

        soak.lab = NetLab(args.peers + args.events + 1, args.rate).__enter__()
    try:
        soak.run()
    finally:
        soak.stop_all()
        if soak.lab is not None:
            soak.lab.close()
    time.sleep(1.0)
    checked = check(soak)
    left = leftovers(root)
    checked["violations"]["leftovers"] = left
    return soak, checked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=6)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--events", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--down", type=float, default=5.0, help="seconds a killed peer stays down")
    p.add_argument("--freeze", type=float, default=35.0, help="seconds a frozen peer (or a throttled link) lasts")
    p.add_argument("--rejoin-rounds", type=int, default=3,
                   help="swarm rounds a restarted peer may take, from resuming, to be back in a group")  # fmt: skip
    p.add_argument("--netns", action="store_true", help="peers in network namespaces (root), links shaped to --rate")
    p.add_argument("--rate", type=float, default=100.0, help="--netns: link rate, Mbit/s")
    p.add_argument("--throttle-mbit", type=float, default=1.0)
    p.add_argument("--baseline", action="store_true", help="also run the same peers churn-free and compare")
    p.add_argument("--run-id", default="soak")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--name", default="soak", help="results: OUT/NAME.json and .png")
    p.add_argument("--out", type=Path, default=common.RESULTS, help="results directory (default benchmarks/results)")
    p.add_argument("--keep", action="store_true", help="keep the peers' directories (printed)")
    p.add_argument("extra", nargs="*", help="after --: more `join` flags for every peer, e.g. -- --mode delayed")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally-blocks stop the peers and the lab
    root = Path(tempfile.mkdtemp(prefix="dilocox-soak-"))
    baseline = None
    if args.baseline:
        quiet = argparse.Namespace(**{**vars(args), "events": 0})
        _, base_checked = run_soak(quiet, root / "baseline", chaos=False)
        baseline = max(base_checked["records"][0].items())[1]["val_loss"]
    soak, checked = run_soak(args, root / "churn", chaos=True)
    report = summarize(soak, checked)
    report["baseline_final_val_loss"] = baseline
    if baseline is not None and report["final_val_loss"] is not None:
        report["final_val_loss_vs_baseline"] = round(report["final_val_loss"] / baseline - 1, 4)
    report["violations"] = checked["violations"]
    report["passed"] = not any(checked["violations"].values())
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    path = common.write_result(args.name, report, directory=args.out)
    timeline(soak, checked, args.out / f"{args.name}.png", baseline)
    print(json.dumps({k: report[k] for k in ("final_val_loss", "baseline_final_val_loss", "violations", "passed")}, indent=2))
    print(f"[soak] results: {path}")
    if args.keep:
        print(f"[soak] peers' directories: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
