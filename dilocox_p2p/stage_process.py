"""The process of one pipeline stage: logging, threads, the peer's process group, the worker.

The launcher (launch.py) forks the stages from a fork server that imported this module (and
torch, and hivemind) once; the launcher itself never imports torch. Under torchrun each
process runs `run_under_torchrun` instead. Stage 0 hosts the peer's rendezvous store (a
TCPStore on a free port) and hands its port to the other stages through the launcher's pipe.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import startup
from .config import Config
from .errors import ConfigError, DilocoxError
from .logs import init_logging, set_log_context
from .peer_layout import make_groups, place_of, resolve_device
from .replicas import follow
from .worker import StageWorker, WorkerSpec

__all__ = ["run_under_torchrun", "stage_main"]

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
STORE_TIMEOUT = timedelta(seconds=60)


def stage_main(
    cfg: Config, *, rank: int, resume: bool, data_seed: int, lead_maddrs: tuple[str, ...], ports: Any,
    own_session: bool = False,
) -> None:
    """Entry point of the stage process of `rank` (peer_layout.py: replica x stages + stage), forked by the
    launcher. `lead_maddrs`: where stage 0's DHT node listens, when the launcher could tell; `ports`: a
    SimpleQueue through which rank 0 gives the other processes its store's port."""
    replica, stage = place_of(rank, cfg.model.stages)
    startup.configure(stage=stage, run_dir=cfg.run.path if replica == 0 else None).mark("stage_process")
    spec = WorkerSpec(cfg=cfg, stage=stage, resume=resume, data_seed=data_seed, lead_maddrs=lead_maddrs,
                      own_session=own_session)  # fmt: skip
    # Ctrl-C on a terminal reaches every process of the group: the launcher forwards one
    # SIGTERM instead, so the stages ignore SIGINT (and so do the DHT processes they fork).
    # SIGTERM stops a stage (the worker installs its graceful handler), unlike the fork server. Until the worker
    # stands, it unwinds the start: the DHT process and p2p daemon a stage has started are shut down on the way
    # out (SIG_DFL left them running, orphaned, holding the launcher's stdout: a join that found no initial peer
    # while its other stage still waited for one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_starting)
    n = cfg.model.stages * cfg.run.replicas
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size=n, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        for _ in range(n - 1):
            ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(), world_size=n, is_master=False, timeout=STORE_TIMEOUT)
    sys.exit(_run_stage(spec, rank=rank, store=store))


def _threads(cfg: Config) -> int:
    return cfg.inner.threads or max(1, (os.cpu_count() or 1) // (cfg.model.stages * cfg.run.replicas))


def _worker_class(cfg: Config) -> type[StageWorker]:
    if not cfg.swarm.enabled:
        return StageWorker
    from .swarm.worker import SwarmStageWorker  # imports hivemind

    return SwarmStageWorker


def _stop_starting(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _run_stage(spec: WorkerSpec, *, rank: int, store: Any = None) -> int:
    cfg = spec.cfg
    replica = rank // cfg.model.stages
    name = f"stage{spec.stage}" + (f".replica{replica}" if replica else "")
    init_logging(cfg.control.log_level, fmt=cfg.control.log_format, file=cfg.run.path / "logs" / f"{name}.log")
    set_log_context(stage=spec.stage)
    torch.set_num_threads(_threads(cfg))
    logger.info("torch %s, CPU capability %s", torch.__version__, torch.backends.cpu.get_cpu_capability())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mp.set_start_method("fork", force=True)  # hivemind's DHT and averager processes are forked from here
    try:
        device = resolve_device(cfg.run.device, rank, cfg.run.devices)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        world = cfg.model.stages * cfg.run.replicas
        if not dist.is_initialized():
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(minutes=10))
        groups = make_groups(rank=rank, stages=cfg.model.stages, replicas=cfg.run.replicas, backend=backend)
        if replica:
            return follow(cfg, stage=spec.stage, groups=groups, device=device, data_seed=spec.data_seed)
        worker = _worker_class(cfg)(spec, device, groups)
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


def run_under_torchrun(cfg: Config, *, resume: bool) -> int:
    """Run as the one stage torchrun's RANK names; rank 0 prepares the run directory for all."""
    from .launch import prepare_run_dir

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stages, replicas = cfg.model.stages, cfg.run.replicas
    if world != stages * replicas:
        raise ConfigError(f"torchrun started {world} processes but the peer has model.stages x run.replicas = {stages} x "
                          f"{replicas} = {stages * replicas}; make them equal (torchrun --nproc-per-node)")  # fmt: skip
    device = resolve_device(cfg.run.device, rank, cfg.run.devices)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))
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
    replica, stage = place_of(rank, stages)
    startup.configure(stage=stage, run_dir=cfg.run.path if replica == 0 else None).mark("stage_process")
    spec = WorkerSpec(cfg=cfg, stage=stage, resume=resume, data_seed=int(message[0]))
    return _run_stage(spec, rank=rank)
