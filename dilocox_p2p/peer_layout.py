"""Where each process of a peer runs: its place (replica, stage), its device and its process groups.

A peer of `model.stages` S and `run.replicas` R runs R x S stage processes in one process group (gloo on
CPU, NCCL on GPUs); a process's rank is replica x S + stage, so replica 0's stages hold ranks 0..S-1, as a
peer of one replica does. Each replica's stages form a pipeline group (activations, the step's global norm
and stop flag), each stage's copies a replicas group (the gradients' mean every step: inner.py; what a
round starts from: replicas.py). Objects travel over gloo groups beside NCCL ones (`*_control`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import ConfigError

__all__ = ["PeerGroups", "make_groups", "place_of", "resolve_device"]


def place_of(rank: int, stages: int) -> tuple[int, int]:
    """(replica, stage) of the process of `rank` in a peer of `stages` stages."""
    return divmod(rank, stages)


@dataclass(frozen=True)
class PeerGroups:
    """The process groups of one stage process (None: the default group, the whole peer, for a peer of one
    replica, as before replicas existed)."""

    replica: int
    replicas: int
    pipeline: dist.ProcessGroup | None
    """This replica's stages, in stage order."""
    control: dist.ProcessGroup | None
    """The same processes over gloo, for objects (None where `pipeline` is gloo already, or the default group)."""
    copies: dist.ProcessGroup | None = None
    """This stage in every replica (None: one replica)."""
    copies_control: dist.ProcessGroup | None = None
    """The same over gloo, for objects."""

    @property
    def objects(self) -> dist.ProcessGroup | None:
        """The group that carries the pipeline's objects (gathers of facts, stop votes)."""
        return self.control or self.pipeline


def make_groups(*, rank: int, stages: int, replicas: int, backend: str) -> PeerGroups:
    """Every group of the peer; every process calls it, and makes every group in the same order (torch's rule)."""
    replica, stage = place_of(rank, stages)
    gloo = backend == "gloo"
    if replicas == 1:
        return PeerGroups(replica=0, replicas=1, pipeline=None, control=None if gloo else dist.new_group(backend="gloo"))
    pipelines = [list(range(r * stages, (r + 1) * stages)) for r in range(replicas)]
    copies = [list(range(s, replicas * stages, stages)) for s in range(stages)]
    pipeline_groups = [dist.new_group(ranks) for ranks in pipelines]
    pipeline_controls = [None if gloo else dist.new_group(ranks, backend="gloo") for ranks in pipelines]
    copy_groups = [dist.new_group(ranks) for ranks in copies]
    copy_controls = [None if gloo else dist.new_group(ranks, backend="gloo") for ranks in copies]
    return PeerGroups(
        replica=replica, replicas=replicas, pipeline=pipeline_groups[replica], control=pipeline_controls[replica],
        copies=copy_groups[stage], copies_control=copy_controls[stage] or copy_groups[stage],
    )  # fmt: skip


def resolve_device(choice: str, rank: int, devices: Sequence[str] = ()) -> torch.device:
    """The device of the stage process of `rank`: the CPU, or its GPU: `devices[rank]` where run.devices names them,
    else cuda:rank (cuda:LOCAL_RANK under torchrun), wrapped around the GPUs this process sees."""
    if not devices and (choice == "cpu" or (choice == "auto" and not torch.cuda.is_available())):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        flag = "--devices" if devices else "--device cuda"
        raise ConfigError(f"{flag}: no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES)")
    count = torch.cuda.device_count()
    if devices:
        device = torch.device(devices[rank])
        if device.index >= count:
            raise ConfigError(f"--devices: stage process {rank} is on {devices[rank]}, but this process sees {count} "
                              f"GPU(s) (cuda:0..cuda:{count - 1}, after CUDA_VISIBLE_DEVICES)")  # fmt: skip
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local % count)
