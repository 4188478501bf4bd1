"""Start one peer: M stage-worker processes with a local process group for the pipeline.

`run_peer` spawns the M workers itself (one machine) or, under torchrun (RANK/WORLD_SIZE
set), runs as the one stage its rank names, so the same code drives a multi-node cluster:

    dilocox-peer join --stages 2                         # spawns 2 stage processes
    torchrun --nnodes 2 --nproc-per-node 1 ... -m dilocox_p2p.cli join --stages 2

The launcher owns the run directory (config.toml, run.json), forwards SIGINT/SIGTERM to
the stages once, and stops the other stages when one of them fails. A stage that gets the
same stop twice within two seconds (signalled as a process group, by systemd or `kill -TERM
-PGID`, and forwarded by the launcher) stops gracefully; asked again later, it leaves at once. It never imports torch:
the stages fork from a fork server that imports it (stage_process.py) while the launcher
runs its checks, so start-up pays for those imports once and in parallel.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from . import __version__, startup
from .checkpoint import latest_common_round
from .config import Config, config_hash, to_toml
from .endpoints import ensure_port_free, fix_stage_ports, local_maddr, stage_maddr
from .errors import CheckpointError, DilocoxError
from .identity import check_worker_key, peer_id_of, worker_identity
from .logs import init_logging

__all__ = ["prepare_run_dir", "run_peer", "wait_for_multiaddrs"]

logger = logging.getLogger(__name__)

_GRACE_S = 20.0


def prepare_run_dir(cfg: Config, *, resume: bool) -> int:
    """Create or check RUN_DIR; return this peer's data seed (kept in run.json)."""
    run_dir = cfg.run.path
    info_path = run_dir / "run.json"
    if resume:
        if not info_path.exists():
            raise CheckpointError(f"--resume: {run_dir} holds no run (no run.json); start it without --resume")
        info = json.loads(info_path.read_text())
        if info.get("config_hash") != config_hash(cfg):
            raise CheckpointError(
                f"--resume: {run_dir} was started with another config (hash {info.get('config_hash', '?')[:12]}, "
                f"now {config_hash(cfg)[:12]}); pass the same --config and flags, or another --run-dir"
            )
        if latest_common_round(run_dir, cfg.model.stages) is None:
            raise CheckpointError(f"--resume: {run_dir} holds no complete checkpoint yet; start it without --resume")
        return int(info["data_seed"])
    found = sorted((run_dir / "checkpoints").glob("stage*/round*.pt"))
    same_run = info_path.exists() and json.loads(info_path.read_text()).get("config_hash") == config_hash(cfg)
    if found and (latest_common_round(run_dir, cfg.model.stages) is not None or not same_run):
        raise CheckpointError(f"{run_dir} already holds a run: continue it with --resume, or pass another --run-dir")
    if found:  # this run crashed while its first checkpoints were written: nothing to resume, nothing to keep
        logger.warning("%s holds checkpoints of only some stages (%d files): nothing to resume; starting afresh",
                       run_dir, len(found))  # fmt: skip
        for path in found:
            path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    seed = cfg.data.seed if cfg.data.seed >= 0 else secrets.randbelow(2**31)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    info = {
        "run_id": cfg.run.run_id,
        "config_hash": config_hash(cfg),
        "data_seed": seed,
        "stages": cfg.model.stages,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "version": __version__,
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    (run_dir / "multiaddrs.txt").unlink(missing_ok=True)
    return seed


def _stage_entry(
    cfg: Config, rank: int, resume: bool, data_seed: int, lead: tuple[str, ...], ports: Any, own_session: bool
) -> None:
    """Entry point of a stage process (forked from the peer's fork server, which imported stage_process)."""
    from .stage_process import stage_main
    from .swarm.hivemind_patches import own_process_locks

    own_process_locks()

    stage_main(cfg, rank=rank, resume=resume, data_seed=data_seed, lead_maddrs=lead, ports=ports,
               own_session=own_session)  # fmt: skip


def _known_lead(cfg: Config) -> tuple[Config, tuple[str, ...]]:
    """Fix the stages' random listen ports and make stage 0's worker key now, so that every stage knows where
    stage 0's DHT node will listen: the other stages start theirs beside it, each joining the moment it
    listens, instead of after it started (one DHT start fewer on the way to the first step)."""
    if not cfg.swarm.enabled or cfg.model.stages == 1:
        return cfg, ()
    hosts = fix_stage_ports(cfg.swarm.host_maddrs, cfg.model.stages)
    cfg = dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, host_maddrs=hosts))
    lead_id = peer_id_of(worker_identity(cfg.run.path / "identity" / "stage0.ed25519"))
    return cfg, tuple(m for m in (local_maddr(stage_maddr(h, 0), lead_id) for h in hosts) if m)


def run_peer(cfg: Config, *, resume: bool) -> int:
    """Run this peer's stages to the end of the run; return the process exit code."""
    timeline = startup.configure(stage=None)
    timeline.mark("process", at=startup.process_start_time())
    timeline.mark("imports")
    init_logging(cfg.control.log_level, fmt=cfg.control.log_format)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from .stage_process import run_under_torchrun

        return run_under_torchrun(cfg, resume=resume)
    ctx = _stage_context(cfg)  # the fork server imports torch (and hivemind) while the checks below run
    _check_ports(cfg)  # one clear error now, not a failed stage later
    data_seed = prepare_run_dir(cfg, resume=resume)
    timeline.attach(cfg.run.path, fresh=not resume)
    if resume:
        _warn_if_alone_again(cfg)
    if cfg.swarm.enabled:  # an unsafe key or a closed run's refusal: one clear error before any stage starts
        from .swarm.credentials import Credentials

        logger.info("peer key %s", Credentials.load(cfg).public_hex)
        for stage in range(cfg.model.stages):  # each stage's worker key too, kept from an earlier start
            check_worker_key(cfg.run.path / "identity" / f"stage{stage}.ed25519")
    cfg, lead = _known_lead(cfg)
    timeline.mark("preflight")
    ports = ctx.SimpleQueue()  # stage 0 hosts the peer's rendezvous store and tells the others its port
    own_session = os.getsid(0) == os.getpid()  # the whole session is this peer's (swarm/priority.py, settle)
    procs = []
    for rank in range(cfg.model.stages * cfg.run.replicas):  # replica 0's stages first (peer_layout.py)
        replica, stage = divmod(rank, cfg.model.stages)
        args = (cfg, rank, resume, data_seed, lead, ports, own_session)
        name = f"stage{stage}" + (f" of replica {replica}" if replica else "")
        proc = ctx.Process(target=_stage_entry, args=args, name=name)
        proc.start()
        procs.append(proc)
    return _supervise(procs)


def _warn_if_alone_again(cfg: Config) -> None:
    """A peer resumed without --initial-peers starts a swarm of its own: say so if it averaged with others
    before (the first peer of a run, restarted with the command that started the run, would train alone)."""
    if not cfg.swarm.enabled or cfg.swarm.initial_peers:
        return
    from .metrics import read_metrics

    records = read_metrics(cfg.run.path / "metrics.jsonl")
    size = max((r.get("group_size") or 0 for r in records[-3:]), default=0)
    if size >= 2:
        logger.warning(
            "resuming a run whose last rounds averaged in groups of %d, without --initial-peers: this peer starts a "
            "swarm of its own and trains alone; to rejoin, pass --initial-peers with a live peer's or a bootstrap "
            "node's multiaddr", size,
        )  # fmt: skip


def _check_ports(cfg: Config) -> None:
    """Every fixed TCP port the peer will listen on (each stage's DHT at PORT + stage, control, metrics) is free."""
    from .doctor import fixed_ports

    for what, flag, host, port in fixed_ports(cfg):
        ensure_port_free(host, port, flag=f"{flag} ({what})" if what.startswith("stage") else flag)


# Modules every stage process needs: a fork server imports them once per peer, and each stage
# forks from it (spawning each stage would import torch and hivemind again: about 2.5 s of CPU
# per stage). The launcher itself imports none of them: the fork server starts
# at once and imports while the launcher checks ports, the run directory and the keys. It
# forks before any stage initializes CUDA or threads.
def _stage_modules(cfg: Config) -> list[str]:
    modules = ["dilocox_p2p.stage_process"]
    if _may_compile(cfg):
        modules.append("torch._dynamo")  # an eager peer never imports it (inner_optimizer.py, pipeline_schedule.py)
    if cfg.swarm.enabled:
        modules.append("dilocox_p2p.swarm.worker")  # hivemind
    return modules


def _may_compile(cfg: Config) -> bool:
    """inner.compile may turn on (resolve_compile): on, or auto where a stage may run on CUDA."""
    return cfg.inner.compile == "on" or (cfg.inner.compile == "auto" and cfg.run.device != "cpu")


def _stage_context(cfg: Config) -> Any:
    if all(name in sys.modules for name in _stage_modules(cfg)) and threading.active_count() == 1:
        # This launcher already holds every module the stages need, and runs no thread: it was forked from an
        # interpreter that had imported them (the swarm tests start their peers so: tests/helpers/zygote.py).
        # The stages fork from it as they would from the fork server, and import nothing again.
        return mp.get_context("fork")
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - not Linux
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_stage_modules(cfg))
    # The fork server ignores SIGTERM (an ignored signal stays ignored across exec): a SIGTERM sent to the
    # whole process group must stop the stages, not the server, whose death would tell the launcher that
    # every stage exited while they are still stopping. It exits when the launcher does. Stages reset it.
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return ctx


def _supervise(procs: list[mp.Process]) -> int:
    """Wait for the stage processes; forward one stop signal; stop all if one fails."""
    signals: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        signals.append(signum)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    failed: int | None = None
    try:
        alive = {p.sentinel: p for p in procs}
        while alive:
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=1.0):
                p = alive.pop(sentinel)
                p.join()
                if p.exitcode != 0 and failed is None and not signals:
                    failed = p.exitcode if p.exitcode and p.exitcode > 0 else 1
                    logger.error("%s exited with code %s; stopping the other stages", p.name, p.exitcode)
                    _stop_all(alive.values())
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if signals:
        return 128 + signals[0]
    return failed or 0


def _stop_all(procs: Any) -> None:
    procs = list(procs)
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()


def wait_for_multiaddrs(run_dir: Path, *, alive: Callable[[], bool], timeout: float = 120.0) -> list[str]:
    """The multiaddrs a starting peer writes to RUN_DIR/multiaddrs.txt (reachable ones first).

    `alive` tells whether the peer is still running; raises DilocoxError if it exits or
    `timeout` passes before the file appears.
    """
    path = Path(run_dir) / "multiaddrs.txt"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        if not alive():
            raise DilocoxError(f"the peer in {run_dir} exited before announcing its multiaddrs")
        time.sleep(0.2)
    raise DilocoxError(f"the peer in {run_dir} did not announce its multiaddrs within {timeout:.0f}s")
