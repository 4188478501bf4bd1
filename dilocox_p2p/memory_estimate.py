"""What one peer needs in memory and on disk, estimated from the model shape (fp32 everywhere; activations
not counted), and what the machine has free: the numbers behind doctor.py's memory and disk checks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .config import ModelShape

__all__ = ["CHECKPOINT_BYTES_PER_PARAM", "MemoryEstimate", "available_ram", "estimate_memory", "gib"]

DEVICE_BYTES_PER_PARAM = {"weights": 4, "gradients": 4, "AdamW moments": 8}
"""fp32 bytes per parameter where inner training runs (one stage's layers)."""
HOST_BYTES_PER_PARAM = {"theta_g": 4, "outer momentum": 4, "pending average": 4, "averager copy": 4}
"""fp32 bytes per parameter a stage worker keeps in RAM on any device (outer.py, swarm/averager.py). Not counted:
error feedback with compression and the trained weights streaming mode keeps (4 B each), activations."""
CHECKPOINT_BYTES_PER_PARAM = {"theta_g": 4, "outer momentum": 4, "pending average": 4, "AdamW moments": 8, "weights": 4}
"""fp32 bytes per parameter in one stage checkpoint (checkpoint.py; measured 24 B/param with the defaults)."""
COMPRESSION_CHECKPOINT_BYTES_PER_PARAM = 4
"""With compression, the error feedback each codec keeps adds this (measured 28 B/param in all)."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes one peer needs: per stage on its training device, in RAM for all stages, on disk for checkpoints."""

    stage_params: tuple[int, ...]
    device_bytes: tuple[int, ...]
    """Per stage, where inner training runs (on CPU this is RAM as well)."""
    host_bytes: int
    """RAM for the outer state of all this peer's stages (plus device_bytes when training on CPU)."""
    checkpoint_bytes: int
    """Disk at peak: the kept checkpoints of every stage plus the one being written."""


def estimate_memory(
    shape: ModelShape, num_stages: int, *, on_cuda: bool, checkpoints_kept: int, compressed: bool = False
) -> MemoryEstimate:
    """Estimate a peer's memory and disk from the model shape (fp32 everywhere; activations not counted)."""
    from .model import stage_layout, unit_param_counts

    counts = unit_param_counts(shape)
    stage_params = tuple(sum(counts[i] for i in units) for units in stage_layout(shape, num_stages))
    device = tuple(n * sum(DEVICE_BYTES_PER_PARAM.values()) for n in stage_params)
    host = sum(stage_params) * sum(HOST_BYTES_PER_PARAM.values()) + (0 if on_cuda else sum(device))
    per_param = sum(CHECKPOINT_BYTES_PER_PARAM.values()) + (COMPRESSION_CHECKPOINT_BYTES_PER_PARAM if compressed else 0)
    disk = sum(stage_params) * per_param * (checkpoints_kept + 1)
    return MemoryEstimate(stage_params, device, host, disk)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def available_ram() -> int:
    """Bytes of RAM available to new processes (MemAvailable), or free pages where /proc is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
