"""Per-stage checkpoints, written atomically (temp file, fsync, rename) at round boundaries.

Layout: RUN_DIR/checkpoints/stage{s}/round{t:06d}.pt holds what stage s needs to start
round t: theta_g, outer momentum, the pending average, inner AdamW state, data position
and RNG state. A run resumes from the newest round that every stage has on disk, so a
crash between two stages' writes costs at most that round.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from .errors import CheckpointError

__all__ = ["latest_common_round", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: outer state keeps the pending average with its kind and missing spans
_NAME = re.compile(r"^round(\d{6,})\.pt$")


def _stage_dir(run_dir: Path, stage: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"stage{stage}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, stage: int, round: int, state: dict[str, Any], *, keep: int = 2) -> Path:
    """Write stage `stage`'s state for the start of `round`; keep the newest `keep` files."""
    folder = _stage_dir(run_dir, stage)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"round{round:06d}.pt"
    tmp = folder / f".{path.name}.tmp"
    for stale in folder.glob(".round*.pt.tmp"):  # left by a process killed mid-write: a whole stage state each
        stale.unlink(missing_ok=True)
    import torch  # here, not at the top: the launcher lists checkpoints without importing torch

    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, "round": round, "stage": stage, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(folder)
    for old in sorted(_rounds(folder))[:-keep]:
        (folder / f"round{old:06d}.pt").unlink(missing_ok=True)
    return path


def _rounds(folder: Path) -> set[int]:
    if not folder.is_dir():
        return set()
    return {int(m.group(1)) for p in folder.iterdir() if (m := _NAME.match(p.name))}


def latest_common_round(run_dir: Path, n_stages: int) -> int | None:
    """The newest round every stage has a checkpoint for, or None."""
    common = set.intersection(*(_rounds(_stage_dir(run_dir, s)) for s in range(n_stages)))
    return max(common) if common else None


def load_checkpoint(run_dir: Path, stage: int, round: int) -> dict[str, Any]:
    import torch

    path = _stage_dir(run_dir, stage) / f"round{round:06d}.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # mapped: no copy of the file
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is missing") from None
    except Exception as e:  # a torn or foreign file
        raise CheckpointError(f"checkpoint {path} cannot be read ({e}); delete it to resume from an older one") from None
    if state.get("format") != FORMAT or state.get("stage") != stage:
        raise CheckpointError(f"checkpoint {path} is not a stage-{stage} checkpoint of this format")
    return state
