"""Start one peer: M stage-worker processes with a local process group for the pipeline.

`run_peer` spawns the M workers itself (one machine) or, under torchrun (RANK/WORLD_SIZE
set), runs as the one stage its rank names, so the same code drives a multi-node cluster:

    dilocox-peer join --stages 2                         # spawns 2 stage processes
    torchrun --nnodes 2 --nproc-per-node 1 ... -m dilocox_p2p.cli join --stages 2

The launcher owns the run directory (config.toml, run.json), forwards SIGINT/SIGTERM to
the stages once, and stops the other stages when one of them fails.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import __version__
from .checkpoint import latest_common_round
from .config import Config, config_hash, to_toml
from .endpoints import ensure_port_free
from .errors import CheckpointError, ConfigError, DilocoxError
from .logs import init_logging, set_log_context
from .worker import StageWorker, WorkerSpec, resolve_device

__all__ = ["prepare_run_dir", "run_peer", "wait_for_multiaddrs"]

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
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


WorkerFactory = Callable[[WorkerSpec, torch.device, Any], StageWorker]


def _threads(cfg: Config) -> int:
    return cfg.inner.threads or max(1, (os.cpu_count() or 1) // cfg.model.stages)


def _stage_process(spec: WorkerSpec, store_port: int, factory: WorkerFactory) -> None:
    """Entry point of a stage process (forked from the peer's fork server)."""
    # Ctrl-C on a terminal reaches every process of the group: the launcher forwards one
    # SIGTERM instead, so the stages ignore SIGINT (and so do the DHT processes they fork).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60))
    sys.exit(_run_stage(spec, factory, store=store))


def _run_stage(spec: WorkerSpec, factory: WorkerFactory, *, store: Any = None) -> int:
    cfg = spec.cfg
    init_logging(cfg.control.log_level, fmt=cfg.control.log_format, file=cfg.run.path / "logs" / f"stage{spec.stage}.log")
    set_log_context(stage=spec.stage)
    torch.set_num_threads(_threads(cfg))
    logger.info("torch %s, CPU capability %s", torch.__version__, torch.backends.cpu.get_cpu_capability())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mp.set_start_method("fork", force=True)  # hivemind's DHT and averager processes are forked from here
    try:
        device = resolve_device(cfg.run.device, spec.stage)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group(
                backend, store=store, rank=spec.stage, world_size=cfg.model.stages, timeout=timedelta(minutes=10)
            )
        control = dist.new_group(backend="gloo") if backend == "nccl" else None
        worker = factory(spec, device, control)
        worker.install_signal_handlers()
        stopped = worker.run()
        return 128 + stopped if stopped else 0
    except DilocoxError as e:
        logger.error("%s", e)
        return e.exit_code
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return 128 + signal.SIGINT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _default_factory(cfg: Config) -> WorkerFactory:
    if not cfg.swarm.enabled:
        return StageWorker
    from .swarm.worker import SwarmStageWorker  # imports hivemind

    return SwarmStageWorker


def run_peer(cfg: Config, *, resume: bool, factory: WorkerFactory | None = None) -> int:
    """Run this peer's stages to the end of the run; return the process exit code."""
    factory = factory or _default_factory(cfg)
    init_logging(cfg.control.log_level, fmt=cfg.control.log_format)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(cfg, resume=resume, factory=factory)
    _check_ports(cfg)  # one clear error now, not a failed stage later
    data_seed = prepare_run_dir(cfg, resume=resume)
    if resume:
        _warn_if_alone_again(cfg)
    if cfg.swarm.enabled:  # an unsafe key or a closed run's refusal: one clear error before any stage starts
        from .swarm.credentials import Credentials

        logger.info("peer key %s", Credentials.load(cfg).public_hex)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = _stage_context()
    procs = []
    for stage in range(cfg.model.stages):
        spec = WorkerSpec(cfg=cfg, stage=stage, resume=resume, data_seed=data_seed)
        proc = ctx.Process(target=_stage_process, args=(spec, store.port, factory), name=f"stage{stage}")
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
# forks from it (spawning each stage would import torch, its pipelining and hivemind again:
# about 4 s of CPU per stage). The server forks before any stage initializes CUDA or threads.
_STAGE_MODULES = ["torch", "torch.distributed.pipelining", "dilocox_p2p.worker", "dilocox_p2p.swarm.worker"]


def _stage_context() -> Any:
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - not Linux
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_STAGE_MODULES)
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


def _run_under_torchrun(cfg: Config, *, resume: bool, factory: WorkerFactory) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != cfg.model.stages:
        raise ConfigError(f"torchrun started {world} processes but model.stages = {cfg.model.stages}; make them equal")
    dist.init_process_group(
        "nccl" if resolve_device(cfg.run.device, rank).type == "cuda" else "gloo", timeout=timedelta(minutes=10)
    )
    message: list[Any] = [None]
    if rank == 0:
        try:
            message = [prepare_run_dir(cfg, resume=resume)]
        except DilocoxError as e:
            message = [str(e)]
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], str):
        if rank == 0:
            logger.error("%s", message[0])
        dist.destroy_process_group()
        return EXIT_USAGE
    spec = WorkerSpec(cfg=cfg, stage=rank, resume=resume, data_seed=int(message[0]))
    return _run_stage(spec, factory)



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
