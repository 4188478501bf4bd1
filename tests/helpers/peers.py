"""Real `dilocox-peer join` processes on loopback, for the swarm tier.

Each peer runs in its own session (process group), so `kill()` takes down every process
of the peer at once (launcher, stage workers, DHT and averager processes, p2pd), as a
crash of the machine would. `stop_all()` leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from dilocox_p2p.errors import DilocoxError
from dilocox_p2p.identity import peer_id_of, worker_identity
from dilocox_p2p.launch import wait_for_multiaddrs
from tests.helpers.ports import free_port
from tests.helpers.zygote import Forked, zygote

# 4 sequences in 2 micro-batches per step, validated on one batch: 2.5x less CPU per step than tiny's 16 in 4 (the same
# loss after 60 steps, measured), and a third less again for the val loss (join evaluates 4 batches: a third of the
# training's CPU under py-spy). Sequences of 64 tokens, not tiny's 128: a lone peer's round of 5 steps took 0.26
# CPU-s instead of 0.42 (a swarm peer's round about 1 CPU-s in all). What the tests check depends on none of these;
# the netns and docker tiers use them too.
LIGHT_BATCH = (
    "--set", "inner.batch_size=4", "--set", "inner.microbatches=2", "--set", "data.val_batches=1",
    "--set", "model.seq_len=64",
)  # fmt: skip

PEER_ARGS = [  # tests name their mode where it matters; the rest exercise the machinery in delayed mode
    "--mode", "delayed",
    # and fp32 through hivemind's exact butterfly (join's default is int8 since 2026-11-29): tests name their
    # compression where it matters (test_compressed_rounds, test_trust...); the netns tier runs join's default
    "--compression", "none",
    "--preset", "tiny",
    "--stages", "2",
    # 5 inner steps a round: most of a swarm test's CPU is its peers training (10 made the tier 14% longer), and
    # what the tests check does not need longer rounds (streaming tests name 10: 2 fragments of 5 steps)
    "--inner-steps", "5",
    "--progress", "lines",
    "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
    "--device", "cpu",
    "--round-wait", "10",
    "--set", "swarm.chunk_timeout=5.0",
    "--set", "swarm.allreduce_timeout=30.0",
    "--set", "inner.threads=1",
    *LIGHT_BATCH,
    # Beside another test (pytest-xdist's other worker), a peer that has settled (its first average applied) must not
    # drop 10 nice levels below the other test's peers: while those start (about 2 CPU-s a stage at nice 0), its
    # averager got a tenth of a core, and its exchange stalled for seconds (a member's parts "never started within
    # 5.0 s" in test_elastic's late-join test under the full tier, 2026-12-02; "every phase ten times its usual
    # length" in CI runs before). Alone on the machine (the netns and docker tiers), peers keep join's default.
    *(("--set", "swarm.settled_nice=0") if os.environ.get("PYTEST_XDIST_WORKER") else ()),
]


def kill_session(proc: subprocess.Popen | Forked) -> None:
    """SIGKILL every process of `proc`'s session (started with start_new_session=True), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


class Peer:
    def __init__(
        self,
        run_dir: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        limits: dict[int, int] | None = None,
        *,
        fresh: bool = False,
    ):
        """`limits`: resource limits (resource.RLIMIT_*: bytes) of the peer's processes, as a container sets them.
        The peer forks from the session's zygote (zygote.py: the same process, without importing torch and
        hivemind again) unless `fresh`, or `env` sets more than DILOCOX_* variables: then it starts as a new
        interpreter, its stages forked from a fork server, exactly as a user's."""
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = run_dir.parent / f"{run_dir.name}.out"
        self.log = open(self.log_path, "a")  # a resumed peer writes after its earlier life
        argv = ["join", "--run-dir", str(run_dir), *PEER_ARGS, *args]
        full_env = {**os.environ, **(env or {})}
        if not fresh and all(k.startswith("DILOCOX_") for k in env or {}):
            self.proc: subprocess.Popen | Forked = zygote().fork(argv, env=full_env, log=self.log_path, limits=limits)
            return

        def limit() -> None:
            for which, value in (limits or {}).items():
                resource.setrlimit(which, (value, value))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dilocox_p2p.cli", *argv], stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True, env=full_env, preexec_fn=limit if limits else None,
        )  # fmt: skip

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return records

    def maddrs(self, timeout: float = 60.0) -> list[str]:
        try:
            return wait_for_multiaddrs(self.run_dir, alive=lambda: self.proc.poll() is None, timeout=timeout)
        except DilocoxError as e:
            raise AssertionError(f"{e}:\n{self.output()}") from None

    def wait_for_round(self, round: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r["round"] >= round for r in self.metrics()):
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"peer exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.2)
        raise AssertionError(f"{self.run_dir} did not finish round {round} in {timeout}s:\n{self.output()}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.run_dir} still running after {timeout}s:\n{self.output()}") from None

    def output(self) -> str:
        self.log.flush()
        text = self.log_path.read_text()
        return text[-6000:]

    def kill(self) -> None:
        """SIGKILL every process of this peer."""
        kill_session(self.proc)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def freeze(self) -> None:
        """SIGSTOP every process of this peer (a swapped-out machine, a preempted VM, a debugger)."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stage_log(self, stage: int) -> str:
        path = self.run_dir / "logs" / f"stage{stage}.log"
        return path.read_text() if path.exists() else ""

    def account(self, round: int) -> str:
        """What this peer recorded of `round` and the last of what its stages logged of the swarm or above
        INFO: evidence for the message of a failed check."""
        record = next((r for r in self.metrics() if r["round"] == round), None)
        lines = [f"{self.run_dir.name} round {round}: " + (
            "no record" if record is None else
            ", ".join(f"{k}={record[k]}" for k in ("kinds", "group_sizes", "groups", "coverage", "stage_hashes"))
            + ", faults " + str({k: v for k, v in record["faults"].items() if v})
        )]
        logs = (self.run_dir / "logs").glob("stage*.log")
        lines += [line for path in sorted(logs) for line in path.read_text().splitlines()
                  if " INFO " not in line or "dilocox_p2p.swarm" in line][-30:]
        return "\n".join(lines)


def accounts(peers: list[Peer], round: int) -> str:
    """Every peer's account of `round` (Peer.account), for the message of a failed agreement check."""
    return "\n".join(peer.account(round) for peer in peers)


def _stages(args: tuple[str, ...]) -> int:
    """The --stages a peer started with `args` (after PEER_ARGS) runs."""
    flags = [*PEER_ARGS, *args]
    return int([flags[i + 1] for i, flag in enumerate(flags) if flag == "--stages"][-1])


class Swarm:
    """Peers of one run; the first starts the swarm, the others join through its multiaddrs."""

    def __init__(self, root: Path, run_id: str):
        self.root, self.run_id = root, run_id
        self.peers: list[Peer] = []
        self.initial: list[str] = []

    def start_peer(self, *args: str, env: dict[str, str] | None = None, run_dir: Path | None = None) -> Peer:
        """Start a peer of this run; with `run_dir`, in that (existing) peer's directory, e.g. to --resume it.

        The first peer starts the swarm at an address known before it runs (a free port, a worker key made
        here), so the others start at once beside it instead of after it announced itself: each joins as
        soon as that address listens."""
        index = len(self.peers)
        seed = [] if "--resume" in args else ["--data-seed", str(index)]
        extra = ["--run-id", self.run_id, *seed, *args]
        run_dir = run_dir or self.root / f"peer{index}"
        if self.initial:
            extra += ["--initial-peers", *self.initial]
        else:
            port = free_port(consecutive=_stages(args))
            key = worker_identity(run_dir / "identity" / "stage0.ed25519")
            extra += ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"]
            self.initial = [f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_of(key)}"]
        peer = Peer(run_dir, extra, env=env)
        self.peers.append(peer)
        return peer

    def stop_all(self) -> None:
        for peer in self.peers:
            if peer.proc.poll() is None:
                peer.kill()
            peer.log.close()
