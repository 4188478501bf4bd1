"""`dilocox-peer demo`: a local swarm on loopback with zero set-up.

Three peers x two pipeline stages train the tiny model on this interpreter's standard
library, averaging pseudo-gradients over a real hivemind DHT one round behind. The demo
prints each peer's rounds, then the plot, the final theta_g hash per stage (equal on every
peer) and the bytes each peer sent, against what fp32 all-reduce at every inner step
would have sent.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..config import load_config
from ..errors import DilocoxError
from ..metrics import read_metrics
from .plot import plot_runs

HELP = "run a 3-peer swarm on this machine (tiny model, Python stdlib as text), then plot it"

PEER_FLAGS = [
    "--preset", "tiny",
    "--stages", "2",
    "--device", "cpu",
    "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
    "--round-wait", "15",
    "--progress", "lines",
    "--log-level", "warning",
    "--set", "inner.threads=1",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help=HELP, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=3, help="peers in the local swarm (default 3)")
    p.add_argument("--rounds", type=int, default=30, help="outer rounds (default 30)")
    p.add_argument("--inner-steps", type=int, default=20, metavar="H", help="inner steps per round (default 20)")
    p.add_argument("--run-dir", metavar="DIR", help="where the peers' run dirs go (default runs/demo-TIMESTAMP)")
    p.set_defaults(func=main)


class _Peer:
    def __init__(self, name: str, run_dir: Path, args: list[str]):
        self.name, self.run_dir = name, run_dir
        cmd = [sys.executable, "-m", "dilocox_p2p.cli", "join", "--run-dir", str(run_dir), *PEER_FLAGS, *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._relay, daemon=True)
        self.thread.start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if "round " in line or "ERROR" in line or "error" in line or line.startswith("  /"):
                print(f"[{self.name}] {line}", flush=True)

    def maddrs(self) -> list[str]:
        from ..launch import wait_for_multiaddrs  # imports torch: not for the commands that only read

        return wait_for_multiaddrs(self.run_dir, alive=lambda: self.proc.poll() is None)


def main(args: argparse.Namespace) -> int:
    if args.peers < 1 or args.rounds < 1 or args.inner_steps < 1:
        raise DilocoxError("--peers, --rounds and --inner-steps must be at least 1")
    root = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if root.exists() and any(root.iterdir()):
        raise DilocoxError(f"{root} is not empty; pass another --run-dir")
    run_id = f"demo-{os.getpid()}"
    common = ["--run-id", run_id, "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps),
              "--min-peers", str(args.peers)]
    print(f"starting {args.peers} peers x 2 stages on loopback (run dirs under {root}) ...", flush=True)
    started = time.time()
    peers = [_Peer("peer0", root / "peer0", [*common, "--data-seed", "0"])]
    try:
        initial = peers[0].maddrs()[:1]
        for k in range(1, args.peers):
            peers.append(_Peer(f"peer{k}", root / f"peer{k}", [*common, "--data-seed", str(k), "--initial-peers", *initial]))
        codes = [p.proc.wait() for p in peers]
    except KeyboardInterrupt:
        for p in peers:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in peers:
            p.proc.wait(60)
        print("demo interrupted; peers stopped", file=sys.stderr)
        return 130
    for p in peers:
        p.thread.join(5)
    if any(codes):
        failed = [f"{p.name} (exit {c}): {' / '.join(p.lines[-3:])}" for p, c in zip(peers, codes) if c]
        raise DilocoxError("the demo swarm failed: " + "; ".join(failed))
    _summary([p.run_dir for p in peers], time.time() - started)
    return 0


def _summary(run_dirs: list[Path], seconds: float) -> None:
    out = plot_runs(run_dirs, run_dirs[0].parent / "plot.png")
    cfg = load_config(run_dirs[0] / "config.toml")
    records = [read_metrics(d / "metrics.jsonl") for d in run_dirs]
    info = json.loads((run_dirs[0] / "run.json").read_text())
    n, params = len(run_dirs), info["params"]
    steps = len(records[0]) * cfg.inner.steps
    # ring all-reduce of fp32 gradients at every inner step: 2 (n-1)/n of the model per step
    fp32_every_step = 2 * (n - 1) / n * params * 4 * steps
    print(f"\ndemo finished in {seconds:.0f}s: {n} peers x {cfg.model.stages} stages, {params:,} parameters, "
          f"{len(records[0])} rounds x {cfg.inner.steps} inner steps")
    for d, recs in zip(run_dirs, records):
        last = recs[-1]
        sent = sum(r["bytes_sent"] for r in recs)
        faults = {k: sum(r["faults"].get(k, 0) for r in recs) for k in ("repairs", "catch_ups")}
        print(f"  {d.name}: val loss {info['initial_val_loss']:.3f} -> {last['val_loss']:.3f}, "
              f"sent {sent / 1e6:.1f} MB ({fp32_every_step / max(sent, 1):.0f}x less than fp32 all-reduce every step), "
              f"repairs {faults['repairs']}, catch-ups {faults['catch_ups']}, "
              f"state per stage {' '.join(h[:12] for h in last['stage_hashes'])}")
    same = len({tuple(r[-1]["stage_hashes"]) for r in records}) == 1
    print(f"final state (theta_g and outer momentum) identical on all peers: {'yes' if same else 'NO'}")
    print(f"plot: {Path(out).resolve()}")
