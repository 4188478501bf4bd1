"""Which `ATEN_CPU_CAPABILITY` values this machine can run (torch's vectorized kernel sets)."""

from __future__ import annotations

import torch

_ORDER = {"DEFAULT": ["default"], "AVX2": ["default", "avx2"], "AVX512": ["default", "avx2", "avx512"],
          "SVE256": ["default", "sve256"], "ZVECTOR": ["default", "zvector"]}  # fmt: skip


def capabilities() -> list[str]:
    """Every capability this machine supports, "default" first and the best last."""
    best = torch.backends.cpu.get_cpu_capability().upper()
    return _ORDER.get(best, ["default", best.lower()])
