#!/usr/bin/env python3
"""Our inner loop against the plain PyTorch loop an operator would write, same model, same device, one run.

    python benchmarks/inner_reference.py                                   # CPU, tiny (no target)
    python benchmarks/inner_reference.py --device cuda --preset 350m --steps 20 --batch-size 16 --microbatches 4

"Ours" is `dilocox-peer join --no-swarm --stages 1` (real stage process, its defaults for
the device: bf16 autocast and torch.compile on CUDA, fp32 eager on CPU), once per outer mode
asked for (`--ours`: the outer step's work beside training differs by mode); its figure is
the median `inner_tokens_per_s` of the rounds after the first (which holds compilation). "Plain"
is a few dozen lines: the same `GPT`, AdamW (fused on CUDA), the same tokens per optimizer
step in the same micro-batches, grad-norm clipping, `loss.item()` once per step, in each
variant asked for (fp32, tf32, bf16 autocast, bf16 autocast + torch.compile of the whole
model or of each block). Each runs in its own child process, one after the other, so each has the device to
itself. Writes benchmarks/results/<name>.json: every figure, the best plain variant and
ours / best.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import write_result  # noqa: E402

VARIANTS = ("fp32", "tf32", "bf16", "bf16-compile", "bf16-compile-units")


def run_ours(args: argparse.Namespace, tmp: Path, spec: str) -> dict:
    """One run of ours; `spec` is an outer mode, then config overrides for this run alone: MODE[+KEY=VALUE...]."""
    mode, *overrides = spec.split("+")
    run_dir = tmp / "ours"
    cmd = [
        sys.executable, "-m", "dilocox_p2p.cli", "join", "--no-swarm", "--run-dir", str(run_dir),
        "--preset", args.preset, "--stages", "1", "--device", args.device, "--mode", mode,
        "--rounds", str(args.rounds), "--inner-steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--microbatches", str(args.microbatches),
        "--progress", "off", "--log-level", "warning", "--data-seed", "0",
        "--set", "run.checkpoint_every=1000", "--set", "data.val_batches=1",  # a 1b checkpoint is 16 GB
        *(f for kv in [*args.set, *overrides] for f in ("--set", kv)),
    ]
    started = time.perf_counter()
    if subprocess.run(cmd).returncode != 0:
        for log in sorted((run_dir / "logs").glob("*.log")):
            print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-30:]), file=sys.stderr)
        raise SystemExit(f"ours ({spec}): join failed (its stage logs above)")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["inner_tokens_per_s"] for r in records[1:]] or [records[0]["inner_tokens_per_s"]]
    return {
        "variant": "ours",
        "mode": mode,
        "overrides": [*args.set, *overrides],
        "tokens_per_s": statistics.median(steady),
        "tokens_per_s_per_round": [r["inner_tokens_per_s"] for r in records],
        "round_tokens_per_s": [r["tokens_per_s"] for r in records],
        "first_round_s": records[0]["seconds_compute"],
        "peak_gpu_bytes": records[-1]["peak_gpu_bytes"][0],
        "wall_s": time.perf_counter() - started,
    }


def run_plain(variant: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, __file__, "--plain", variant, "--device", args.device, "--preset", args.preset,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
        "--microbatches", str(args.microbatches),
    ]
    started = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"variant": variant, **result, "wall_s": time.perf_counter() - started}


def plain_loop(args: argparse.Namespace) -> dict:
    """The loop an operator writes in an afternoon; prints one JSON line."""
    import contextlib

    import torch

    from dilocox_p2p.config import PRESETS
    from dilocox_p2p.model import GPT, lm_loss

    device, variant = torch.device(args.device), args.plain
    shape = PRESETS[args.preset]
    torch.backends.cuda.matmul.allow_tf32 = variant != "fp32"
    torch.backends.cudnn.allow_tf32 = variant != "fp32"
    torch.manual_seed(0)
    model = GPT(shape, seed=0).to(device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if cuda else {"foreach": True}))
    forward = torch.compile(model) if variant.endswith("compile") else model
    if variant.endswith("compile-units"):  # each block (and the embedding, the head) its own graph, as ours by default
        for unit in model.stage.layers:
            unit.compile()
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if variant.startswith("bf16") else (
        contextlib.nullcontext)
    n = args.microbatches
    data = torch.randint(0, 256, (args.warmup + args.steps, args.batch_size, shape.seq_len + 1))

    def step(i: int) -> float:
        batch = data[i].to(device, non_blocking=True)
        for mb in batch.tensor_split(n):
            with autocast():
                loss = lm_loss(forward(mb[:, :-1]), mb[:, 1:])
            (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    started = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    warmup_s = time.perf_counter() - started
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    seconds = time.perf_counter() - started
    tokens = args.steps * args.batch_size * shape.seq_len
    return {
        "tokens_per_s": tokens / seconds,
        "warmup_s": warmup_s,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps (plain) / inner steps per round (ours)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each plain variant (compilation)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of ours; the first is not counted")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                        help="plain variants (default: all on CUDA; fp32 and bf16 on CPU)")
    parser.add_argument("--ours", nargs="+", default=["delayed", "streaming"], metavar="MODE[+KEY=VALUE...]",
                        help="runs of ours, one each: an outer mode, then overrides for that run alone "
                        "(delayed+inner.compile_scope=stage)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for ours")
    parser.add_argument("--name", default=None, help="result name (default inner_reference_<device>_<preset>)")
    parser.add_argument("--plain", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process of one variant
    args = parser.parse_args()
    if args.plain:
        print(json.dumps(plain_loop(args)), flush=True)
        return 0
    variants = args.variants or (list(VARIANTS) if args.device == "cuda" else ["fp32", "bf16"])
    results, ours = [], {}
    for spec in args.ours:
        with tempfile.TemporaryDirectory() as tmp:
            ours[spec] = run_ours(args, Path(tmp), spec)
        print(f"ours ({spec}): {ours[spec]['tokens_per_s']:,.0f} tokens/s", flush=True)
    for variant in variants:
        result = run_plain(variant, args)
        print(f"plain {variant}: {result['tokens_per_s']:,.0f} tokens/s", flush=True)
        results.append(result)
    best = max(results, key=lambda r: r["tokens_per_s"])
    ratios = {mode: r["tokens_per_s"] / best["tokens_per_s"] for mode, r in ours.items()}
    summary = {"best_plain": best["variant"], "ours_over_best_plain": ratios}
    for mode, ratio in ratios.items():
        print(f"ours ({mode}) / plain {best['variant']}: {ratio:.3f}", flush=True)
    name = args.name or f"inner_reference_{args.device}_{args.preset}"
    path = write_result(name, {"config": {k: v for k, v in vars(args).items() if k != "plain"},
                               "ours": ours, "plain": results, **summary})
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
