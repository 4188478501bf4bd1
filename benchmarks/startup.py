#!/usr/bin/env python3
"""Start-up, phase by phase: a lone peer, a joiner of a live swarm, a --resume after SIGKILL, quiet and loaded.

    python benchmarks/startup.py                    # every scenario (5-8 minutes on 2 cores; --baseline: twice the swarm ones)
    python benchmarks/startup.py --scenarios lone_warm joiner --repeats 5
    python benchmarks/startup.py --scenarios joiner resume_busy --baseline swarm.settled_nice=0

Every peer writes when each phase of its start ended (RUN_DIR/startup.jsonl, dilocox_p2p/startup.py);
this script starts real `dilocox-peer join` processes (tiny, 2 stages, CPU, as a new user's first
try) and reads those marks. Scenarios:

    lone_cold    a lone peer, its machine's corpus cache empty            phases to its first inner step
    lone_warm    the same, the cache filled by the run before
    joiner       a new peer joins a live swarm of 2 peers                 phases to its first exchange in a group
    resume       a peer of a 2-peer swarm is SIGKILLed and restarted at once with --resume
    resume_busy  the same in a swarm of 6 peers: 5 busy peers train beside it on the same cores

Phases, in the order they end on the lead stage (they overlap; each bar segment is the time since the
segment before, so the bar is the critical path): imports (the launcher), preflight (ports, run dir,
keys), stage_process (the fork server imports torch and hivemind), model, dht (the DHT node and its
p2p daemon), corpus, joined (admission, start barrier, state download), first_step, first_exchange
(the first round trained), first_group (matchmaking and the all-reduce of the first exchange in a
group). Each scenario repeats --repeats times; the report holds every run and the median per phase.
Targets (issue 41, 2 cores): lone_warm to the first inner step <= 3 s; joiner in a group <= 8 s;
resume_busy back in a group <= 20 s. Writes benchmarks/results/startup.json and startup.png, with
`import_floor`: the stages' imports alone in a fresh interpreter, the part of every start no change of
the peer's own removes, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, write_result  # noqa: E402
from dilocox_p2p import startup  # noqa: E402
from dilocox_p2p.launch import wait_for_multiaddrs  # noqa: E402
from dilocox_p2p.metrics import read_metrics  # noqa: E402

SCENARIOS = ("lone_cold", "lone_warm", "joiner", "resume", "resume_busy")
TARGETS = {"lone_warm": ("first_step", 3.0), "joiner": ("first_group", 8.0), "resume_busy": ("first_group", 20.0)}
PHASES = ("imports", "preflight", "stage_process", "model", "dht", "corpus", "joined", "first_step", "first_exchange",
          "first_group")  # fmt: skip
PEER_FLAGS = [
    "--preset", "tiny", "--stages", "2", "--inner-steps", "10", "--device", "cpu", "--progress", "lines",
    "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--round-wait", "10", "--set", "inner.threads=1",
]  # fmt: skip


class Peer:
    """One `dilocox-peer join` process in its own session (a kill takes all of it)."""

    def __init__(self, run_dir: Path, args: list[str], env: dict[str, str]):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir.parent / f"{run_dir.name}.out", "a")
        cmd = [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-dir", str(run_dir), *PEER_FLAGS, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def maddr(self) -> str:
        return wait_for_multiaddrs(self.run_dir, alive=lambda: self.proc.poll() is None, timeout=120)[0]

    def wait_for(self, what: str, *, life: int = -1, timeout: float = 180.0) -> list[dict[str, Any]]:
        """Wait until the lead stage marked `what` in the given life; that life's marks."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lives = startup.read_lives(self.run_dir)
            if len(lives) >= (life + 1 if life >= 0 else 1):
                marks = lives[life]
                if any(m["phase"] == what and m["stage"] == 0 for m in marks):
                    return marks
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.run_dir.name} exited with {self.proc.returncode}; see {self.log.name}")
            time.sleep(0.1)
        raise SystemExit(f"{self.run_dir.name}: no {what} within {timeout:.0f}s; see {self.log.name}")

    def wait_for_round(self, round: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(r["round"] >= round for r in read_metrics(self.run_dir / "metrics.jsonl")):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"{self.run_dir.name} did not finish round {round}; see {self.log.name}")
            time.sleep(0.2)

    def stop(self, signum: int = signal.SIGKILL) -> None:
        """SIGKILL: the whole peer at once (a crash). SIGTERM: the launcher only, as `docker stop` or a supervisor
        does; it stops its stages, which tell the swarm they leave. (A SIGTERM to the whole process group, as
        systemd sends, also kills the DHT processes first: the leave record is then lost, and the others wait
        for the peer's heartbeat to expire, up to 15 s.)"""
        try:
            if signum == signal.SIGTERM:
                self.proc.send_signal(signum)
            else:
                os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


FLOOR_MODULES = ("dilocox_p2p.stage_process", "dilocox_p2p.swarm.worker")


def import_floor(repeats: int, env: dict[str, str]) -> dict[str, Any]:
    """The fork server's imports alone (launch._stage_modules of a 2-stage swarm peer), each in a fresh
    interpreter: the part of `stage_process` no change to the peer's own start-up removes, on this machine."""
    code = f"import time; t = time.perf_counter(); import {', '.join(FLOOR_MODULES)}; print(time.perf_counter() - t)"
    seconds = [float(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                    text=True).stdout) for _ in range(repeats)]  # fmt: skip
    return {"modules": list(FLOOR_MODULES), "seconds": [round(x, 3) for x in seconds],
            "median": round(statistics.median(seconds), 3)}  # fmt: skip


def path_of(marks: list[dict[str, Any]], until: str) -> dict[str, float]:
    """The lead stage's critical path of one life up to `until`, as {phase: seconds}."""
    return dict(startup.phases(marks, until=until))


class Lab:
    """Runs the scenarios in one temporary directory; every process it starts is stopped on the way out."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root, self.env, self.peers, self.runs = root, env, [], 0
        self.flags: list[str] = []  # every peer's extra flags (the --baseline variant's --set)

    def peer(self, args: list[str], *, name: str | None = None, run_dir: Path | None = None) -> Peer:
        self.runs += 1
        peer = Peer(run_dir or self.root / (name or f"peer{self.runs}"), [*args, *self.flags], self.env)
        self.peers.append(peer)
        return peer

    def swarm(self, n: int, run_id: str) -> list[Peer]:
        """n peers of one run, training for long (the first starts it), each past its first round."""
        args = ["--run-id", run_id, "--rounds", "1000", "--mode", "delayed"]
        first = self.peer([*args, "--data-seed", "0"], name=f"{run_id}-0")
        initial = ["--initial-peers", first.maddr()]
        peers = [first] + [self.peer([*args, "--data-seed", str(i), *initial], name=f"{run_id}-{i}") for i in range(1, n)]
        for peer in peers:
            peer.wait_for_round(0)
        return peers

    def close(self) -> None:
        for peer in self.peers:
            if peer.proc.poll() is None:
                peer.stop()


def lone(lab: Lab, *, cold: bool) -> dict[str, float]:
    if cold:
        lab.env["DILOCOX_CACHE_DIR"] = str(lab.root / f"cache{lab.runs}")
    peer = lab.peer(["--rounds", "1"])
    marks = peer.wait_for("first_step")
    peer.proc.wait(120)
    peer.log.close()
    return path_of(marks, "first_step")


def joiner(lab: Lab, hosts: list[Peer], run_id: str) -> dict[str, float]:
    peer = lab.peer(["--run-id", run_id, "--rounds", "1000", "--mode", "delayed", "--initial-peers", hosts[0].maddr()])
    marks = peer.wait_for("first_group")
    peer.stop(signal.SIGTERM)  # a clean leave: the swarm stops expecting it at once
    return path_of(marks, "first_group")


def resume(lab: Lab, victim: Peer, hosts: list[Peer], run_id: str) -> tuple[dict[str, float], Peer]:
    """SIGKILL `victim` once it is in a group, restart it at once with --resume; its path back into a group."""
    lives = len(startup.read_lives(victim.run_dir))
    victim.wait_for("first_group", life=lives - 1)
    victim.wait_for_round(max(r["round"] for r in read_metrics(victim.run_dir / "metrics.jsonl")) + 1)
    victim.stop(signal.SIGKILL)
    args = ["--run-id", run_id, "--rounds", "1000", "--mode", "delayed", "--resume", "--initial-peers", hosts[0].maddr()]
    again = lab.peer(args, run_dir=victim.run_dir)
    marks = again.wait_for("first_group", life=lives)
    return path_of(marks, "first_group"), again


def summarize(runs: list[dict[str, float]], scenario: str) -> dict[str, Any]:
    phases = [p for p in PHASES if any(p in r for r in runs)]
    median = {p: round(statistics.median(r.get(p, 0.0) for r in runs), 3) for p in phases}
    totals = [round(sum(r.values()), 3) for r in runs]
    out: dict[str, Any] = {"phases": median, "total_median": round(statistics.median(totals), 3), "totals": totals,
                           "runs": [{p: round(s, 3) for p, s in r.items()} for r in runs]}  # fmt: skip
    if scenario in TARGETS:
        until, limit = TARGETS[scenario]
        out["target"] = {"until": until, "seconds": limit, "met": out["total_median"] <= limit}
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report)
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.6 * len(names)))
    colors = plt.get_cmap("tab10")
    for row, name in enumerate(names):
        left = 0.0
        for i, phase in enumerate(PHASES):
            width = report[name]["phases"].get(phase, 0.0)
            if width > 0:
                ax.barh(row, width, left=left, color=colors(i), label=phase if row == 0 or phase not in
                        {p for n in names[:row] for p in report[n]["phases"]} else None)  # fmt: skip
                left += width
        target = report[name].get("target")
        if target:
            ax.plot([target["seconds"]] * 2, [row - 0.4, row + 0.4], color="black", linewidth=2)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since `dilocox-peer join` started (median of the repeats; black: target)")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend([seen[p] for p in PHASES if p in seen], [p for p in PHASES if p in seen], fontsize=7, ncol=5,
              loc="upper center", bbox_to_anchor=(0.5, -0.18))  # fmt: skip
    ax.set_title("start-up phases, tiny, 2 stages, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    lab = Lab(root, {**os.environ, "PYTHONUNBUFFERED": "1", "DILOCOX_CACHE_DIR": str(root / "cache")})
    report: dict[str, Any] = {}
    try:
        if "lone_cold" in args.scenarios or "lone_warm" in args.scenarios:
            cold, warm = [], []
            for _ in range(args.repeats):
                cold.append(lone(lab, cold=True))  # a fresh, empty cache
                warm.append(lone(lab, cold=False))  # the cache that run filled
                print(f"[startup] lone: cold {sum(cold[-1].values()):.2f} s, warm {sum(warm[-1].values()):.2f} s", flush=True)
            for name, runs in (("lone_cold", cold), ("lone_warm", warm)):
                if name in args.scenarios:
                    report[name] = summarize(runs, name)
        for i, variant in enumerate(["", *args.baseline]):  # the swarm scenarios, then again with each baseline
            lab.flags = ["--set", variant] if variant else []
            report.update(swarm_scenarios(lab, args, suffix=f" @{variant}" if variant else "", tag=str(i)))
    finally:
        lab.close()
    for variant in args.baseline:
        for name in [n for n in list(report) if n + f" @{variant}" in report]:
            report[name]["vs_baseline"] = {variant: round(report[name]["total_median"] /
                                                          report[name + f" @{variant}"]["total_median"], 3)}  # fmt: skip
    return report


def swarm_scenarios(lab: Lab, args: argparse.Namespace, *, suffix: str, tag: str) -> dict[str, Any]:
    """The joiner and resume scenarios with `lab.flags`; `tag` keeps each variant's runs and directories apart."""
    report: dict[str, Any] = {}
    if "joiner" in args.scenarios:
        run_id = f"joiner{tag}"
        hosts = lab.swarm(2, run_id)
        runs = []
        for _ in range(args.repeats):
            runs.append(joiner(lab, hosts, run_id))
            print(f"[startup] joiner{suffix}: {sum(runs[-1].values()):.2f} s", flush=True)
        report["joiner" + suffix] = summarize(runs, "joiner")
        for peer in hosts:
            peer.stop()
    for name, size in (("resume", 2), ("resume_busy", 1 + args.busy)):
        if name not in args.scenarios:
            continue
        run_id = f"{name}{tag}"
        peers = lab.swarm(size, run_id)
        victim, hosts, runs = peers[-1], peers[:-1], []
        for _ in range(args.repeats):
            path, victim = resume(lab, victim, hosts, run_id)
            runs.append(path)
            print(f"[startup] {name}{suffix}: {sum(path.values()):.2f} s", flush=True)
        report[name + suffix] = summarize(runs, name)
        for peer in [*hosts, victim]:
            peer.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", type=int, default=5, help="resume_busy: peers training beside the restarted one")
    p.add_argument("--name", default="startup", help="results: OUT/NAME.json and .png")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep", action="store_true", help="keep the peers' directories (printed)")
    p.add_argument("--baseline", action="append", default=[], metavar="KEY=VALUE",
                   help="run the swarm scenarios again with every peer given --set KEY=VALUE, side by side "
                        "(e.g. swarm.settled_nice=0); each result gets vs_baseline, its median over the baseline's")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally-blocks stop every peer
    root = Path(tempfile.mkdtemp(prefix="dilocox-startup-"))
    floor = import_floor(args.repeats, {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    print(f"[startup] the stages' imports alone (fresh interpreter): {floor['median']:.2f} s", flush=True)
    report = run(args, root)
    settings = {"repeats": args.repeats, "busy": args.busy, "peer_flags": PEER_FLAGS, "baselines": args.baseline}
    path = write_result(args.name, {"scenarios": report, "import_floor": floor, "settings": settings}, directory=args.out)
    plot(report, args.out / f"{args.name}.png")
    for name, result in report.items():
        target = result.get("target")
        verdict = "" if not target else f" (target {target['seconds']} s to {target['until']}: " + \
            ("met)" if target["met"] else "NOT met)")  # fmt: skip
        print(f"[startup] {name}: {result['total_median']:.2f} s{verdict}  " +
              ", ".join(f"{k} {v:.2f}" for k, v in result["phases"].items()))  # fmt: skip
    print(f"[startup] results: {path}")
    if args.keep:
        print(f"[startup] peers' directories: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
