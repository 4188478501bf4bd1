"""Churn soak: many peers, many rounds, seeded chaos; the swarm must stay in agreement and keep learning.

    python benchmarks/soak.py                                  # 6 peers x 2 stages, 50 rounds, 12 events
    python benchmarks/soak.py --peers 4 --rounds 15 --events 3 # the short soak (tests/swarm/test_soak.py)
    sudo python benchmarks/soak.py --netns                     # peers in network namespaces, + link throttling
    python benchmarks/soak.py --baseline                       # also a churn-free run of the same peers

Chaos, drawn from --seed and triggered when the swarm reaches a round:
    kill     SIGKILL of a peer's whole process group (launcher, stages, DHT, p2pd), restarted with --resume
             after --down seconds
    join     a brand-new peer (its own run dir and data seed) joins the running swarm
    freeze   SIGSTOP of a peer's process group for --freeze seconds (longer than the swarm's timeouts), SIGCONT
    throttle (--netns) one peer's link drops to --throttle-mbit for --freeze seconds, then is restored

Invariants, checked from every peer's metrics.jsonl and logs (`check`):
    agreement    at every round, a peer whose stage hash differs from the majority of the peers that completed
                 that round (most holders; a tie goes to the smallest peer id, as the swarm's hash checks decide)
                 is back on the majority's hash one round later: the hash check that finds it runs during the
                 next round, so it trains one round on a diverged state, never two
    resumption   a killed peer resumes from its last checkpoint ("resumed from round k", k >= the last round it
                 recorded) and is back in a group of >= 2 within --rejoin-rounds swarm rounds of its restart
    crashes      every peer process exits 0, except the ones the soak killed
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

from benchmarks.common import RESULTS, write_result  # noqa: E402
from dilocox_p2p.swarm.agreement import majority_hash  # noqa: E402

KINDS = ("kill", "join", "freeze", "throttle")
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


@dataclass
class SoakPeer:
    index: int
    run_dir: Path
    cmd: list[str]
    proc: subprocess.Popen | None = None
    log: Any = None
    kills: list[dict] = field(default_factory=list)  # {time, last_round, restart_time}
    frozen_until: float | None = None
    joined_at: float = 0.0


class Soak:
    def __init__(self, args: argparse.Namespace, root: Path, *, chaos: bool):
        self.args, self.root, self.chaos = args, root, chaos
        self.rng = random.Random(args.seed)
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self.syncs = sync_rounds_per_round(args.extra)  # records count sync rounds (rounds x fragments)
        self.peers: list[SoakPeer] = []
        self.events = schedule(args, self.rng) if chaos else []
        self.lab = None
        self.pending: list[tuple[float, str, int]] = []  # (due time, action, peer)

    # ----- processes -----------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    def start_peer(self, index: int, *, resume: bool = False) -> SoakPeer:
        if index < len(self.peers):
            peer = self.peers[index]
        else:
            run_dir = self.root / f"peer{index}"
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-id", self.args.run_id, "--run-dir", str(run_dir),
                "--preset", "tiny", "--stages", str(self.args.stages), "--rounds", str(self.args.rounds),
                "--inner-steps", str(self.args.inner_steps), "--device", "cpu", "--progress", "lines",
                "--data-seed", str(index), "--host-maddrs", f"/ip4/{self.host_ip(index)}/tcp/0", *SWARM_FLAGS,
                *self.args.extra,
            ]  # fmt: skip
            if self.peers:
                cmd += ["--initial-peers", *self.initial()]
            peer = SoakPeer(index, run_dir, cmd, joined_at=self.now())
            self.peers.append(peer)
            if index < self.args.peers:  # the first peers start round 0 together; joiners and restarts never wait
                peer.log = open(peer.run_dir.parent / f"peer{index}.out", "a")
                return self._spawn(peer, cmd + ["--min-peers", str(self.args.peers)])
        peer.log = open(peer.run_dir.parent / f"peer{index}.out", "a")
        return self._spawn(peer, peer.cmd + (["--resume"] if resume else []))

    def _spawn(self, peer: SoakPeer, cmd: list[str]) -> SoakPeer:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.lab is not None:
            peer.proc = self.lab.popen(peer.index, cmd, stdout=peer.log, stderr=subprocess.STDOUT, env=env)
        else:
            peer.proc = subprocess.Popen(cmd, stdout=peer.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        return peer

    def host_ip(self, index: int) -> str:
        return self.lab.ip(index) if self.lab is not None else "127.0.0.1"

    def initial(self) -> list[str]:
        from dilocox_p2p.launch import wait_for_multiaddrs

        first = self.peers[0]
        return wait_for_multiaddrs(first.run_dir, alive=lambda: first.proc.poll() is None)[:1]

    def alive(self, peer: SoakPeer) -> bool:
        return peer.proc is not None and peer.proc.poll() is None

    def signal_group(self, peer: SoakPeer, signum: int) -> None:
        try:
            os.killpg(peer.proc.pid, signum)
        except ProcessLookupError:
            pass

    # ----- chaos ---------------------------------------------------------------------------------
    def swarm_round(self) -> int:
        """The swarm's progress: the most rounds any peer has recorded."""
        return max((len(read_records(p.run_dir)) for p in self.peers), default=0)

    def fire_due(self) -> None:
        current = self.swarm_round()
        for event in self.events:
            if event.time is None and current >= event.round and not self.pending:
                self.fire(event, current)
                return  # one event at a time: the next waits for this one to be undone
        now = self.now()
        for due, action, index in list(self.pending):
            if now >= due:
                self.pending.remove((due, action, index))
                self.undo(action, index)

    def candidates(self) -> list[SoakPeer]:
        """Live, unfrozen peers: any may be hit (joiners learn the others from the DHT, not only peer 0)."""
        return [p for p in self.peers if self.alive(p) and p.frozen_until is None]

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
                peer.kills.append({"time": event.time, "last_round": len(read_records(peer.run_dir)) - 1})
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

    # ----- the run -----------------------------------------------------------------------------------
    def run(self) -> None:
        for index in range(self.args.peers):
            self.start_peer(index)
        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            self.fire_due()
            if not self.pending and all(e.time is not None for e in self.events) and all(
                not self.alive(p) for p in self.peers
            ):
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
    first, last = 2, max(3, args.rounds - 4)  # leave the last rounds to settle
    rounds = sorted(rng.randint(first, last) for _ in picks)
    return [Event(round=r, kind=k) for r, k in zip(rounds, picks)]


# ----- reading what happened --------------------------------------------------------------------------
def read_records(run_dir: Path) -> list[dict]:
    from dilocox_p2p.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def peer_logs(run_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("stage*.log")))


def check(soak: Soak) -> dict[str, Any]:
    """The invariants (module docstring) as {name: list of violations}, and the figures of the report."""
    records = {p.index: {r["round"]: r for r in read_records(p.run_dir)} for p in soak.peers}
    violations: dict[str, list[str]] = {"agreement": [], "resumption": [], "crashes": [], "learning": []}
    rounds = sorted({t for recs in records.values() for t in recs})
    diverged: dict[tuple[int, int], int] = {}  # (peer, stage) -> last round it held a minority hash
    ids = {(p.index, s): worker_peer_id(p.run_dir, s) for p in soak.peers for s in range(soak.args.stages)}
    for t in rounds:
        here = {i: recs[t] for i, recs in records.items() if t in recs}
        for stage in range(soak.args.stages):
            # the majority as the swarm's own hash checks define it: most holders, a tie to the smallest peer id
            majority = majority_hash({ids[(i, stage)]: r["stage_hashes"][stage] for i, r in here.items()})
            for i, r in here.items():
                if r["stage_hashes"][stage] != majority:
                    if diverged.get((i, stage)) == t - 1:
                        violations["agreement"].append(f"peer{i} stage {stage}: minority hash at rounds {t - 1} and {t}")
                    diverged[(i, stage)] = t
    for peer in soak.peers:
        logs = peer_logs(peer.run_dir)
        resumed = [int(k) for k in re.findall(r"resumed from round (\d+)", logs)]
        for n, kill in enumerate(peer.kills):
            if n >= len(resumed) or resumed[n] < kill["last_round"]:  # checkpoint k starts round k: last + 1
                violations["resumption"].append(f"peer{peer.index}: kill {n} at round {kill['last_round']}, resumed {resumed}")
            back = [t for t, r in records[peer.index].items() if r["time"] > soak.t0_wall + kill.get("restart_time", 0)
                    and (r.get("group_size") or 0) >= 2]  # fmt: skip
            kill["back_round"] = min(back) if back else None
            kill["seconds_to_rejoin"] = (
                round(min(records[peer.index][t]["time"] for t in back) - soak.t0_wall - kill["restart_time"], 1)
                if back and "restart_time" in kill else None
            )  # fmt: skip
            if not back or kill["back_round"] - kill.get("restart_round", kill["last_round"]) > soak.args.rejoin_rounds:
                violations["resumption"].append(f"peer{peer.index}: not back in a group within {soak.args.rejoin_rounds} "
                                                f"rounds of restart {n} (restarted at swarm round "
                                                f"{kill.get('restart_round')}, back at {kill.get('back_round')})")  # fmt: skip
        if peer.proc is not None and peer.proc.returncode not in (0, None):
            violations["crashes"].append(f"peer{peer.index} exited {peer.proc.returncode}")
    vals = [r["val_loss"] for t, r in sorted(records[0].items())]
    quarter = max(1, len(vals) // 4)
    initial = json.loads((soak.peers[0].run_dir / "run.json").read_text())["initial_val_loss"]
    if not (vals and vals[-1] < initial and sum(vals[-quarter:]) < sum(vals[:quarter])):
        violations["learning"].append(f"val loss {initial:.3f} -> {vals[-1] if vals else None}")
    return {"violations": violations, "records": records}


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
            "bytes_sent": sum(r["bytes_sent"] for r in recs.values()),
            "bytes_received": sum(r["bytes_received"] for r in recs.values()),
            "kills": peer.kills,
            "final_val_loss": recs[max(recs)]["val_loss"] if recs else None,
        }
    return {"events": [asdict(e) for e in soak.events], "peers": peers,
            "final_val_loss": max(records[0].items())[1]["val_loss"] if records[0] else None}  # fmt: skip


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
    p.add_argument("--rejoin-rounds", type=int, default=6,
                   help="swarm rounds a restarted peer may take, from its restart, to be back in a group")  # fmt: skip
    p.add_argument("--netns", action="store_true", help="peers in network namespaces (root), links shaped to --rate")
    p.add_argument("--rate", type=float, default=100.0, help="--netns: link rate, Mbit/s")
    p.add_argument("--throttle-mbit", type=float, default=1.0)
    p.add_argument("--baseline", action="store_true", help="also run the same peers churn-free and compare")
    p.add_argument("--run-id", default="soak")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--name", default="soak", help="results: benchmarks/results/NAME.json and .png")
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
    report["settings"] = {k: v for k, v in vars(args).items() if k != "extra"} | {"extra": args.extra}
    path = write_result(args.name, report)
    timeline(soak, checked, RESULTS / f"{args.name}.png", baseline)
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
