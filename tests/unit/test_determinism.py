"""theta_g is bit-identical on any CPU: the outer step and every decode give the same bytes
under each ATEN_CPU_CAPABILITY this machine supports, and on 1 thread or all cores (DESIGN.md,
"Agreement"; outer.py's rule).

    pytest tests/unit/test_determinism.py -q

Each capability runs in its own subprocess (torch reads the variable at import) on the same
random shapes and values (tests/helpers/determinism_probe.py). A fused multiply-add
(`add` with `alpha`) is run too, as a control: it must differ, or the capabilities would
not really differ here and the comparison would prove nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cpu import capabilities

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
GUARDED = ("init", "outer_step", "ordered_mean", "decode", "fill_missing", "quantize", "topk", "lowrank", "stage_codec",
           "norms")  # fmt: skip


def _probe(capability: str, seed: int, threads: int = 0) -> dict[str, str]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    cmd = [sys.executable, "-m", "tests.helpers.determinism_probe", "--seed", str(seed), "--cases", "40",
           "--threads", str(threads)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_model_init_outer_step_and_decodes_give_the_same_bytes_under_every_cpu_capability():
    caps = capabilities()
    if len(caps) < 2:
        reason = f"this CPU offers only {caps}: nothing to compare"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    # the first capability at torch's default thread count (this machine's cores), the others on one thread: each
    # comparison crosses both (the norms that screen compressed messages were thread-dependent)
    results = {cap: _probe(cap, seed=0, threads=0 if i == 0 else 1) for i, cap in enumerate(caps)}
    for cap, result in results.items():
        assert result["capability"].lower() == cap, f"ATEN_CPU_CAPABILITY={cap} was not applied: {result}"
    reference = results[caps[0]]
    for cap in caps[1:]:
        for name in GUARDED:
            assert results[cap][name] == reference[name], f"{name} differs between {caps[0]} and {cap}"
    assert len({r["fused_control"] for r in results.values()}) > 1, "the control (a fused multiply-add) did not differ"
