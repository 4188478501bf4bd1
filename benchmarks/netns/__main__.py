"""Ours against DDP and OpenDiLoCo-style hivemind on shaped links, side by side in one run (needs root).

    sudo .venv/bin/python -m benchmarks.netns            # the whole benchmark, about 17 min on 2 quiet cores
    sudo .venv/bin/python -m benchmarks.netns --smoke    # every variant and the all-reduce part, a few rounds

(run from the repository root; `python benchmarks/netns` works too.) 4 peers, each in its own network
namespace behind a `tc tbf` link (both directions; netem is absent here, so bandwidth but no added
latency), train the `tiny` model with 1 pipeline stage at equal tokens per peer (rounds x H x batch x
seq) as:

    nocomm         each peer alone (`join --no-swarm`): the upper bound, and the calibration
    ddp-gloo       gloo all_reduce of the gradients every inner step (baselines.py)
    hivemind-fp16  hivemind DecentralizedAverager, fp16, blocking, every H steps (OpenDiLoCo; baselines.py)
    sync-fp32      ours, `--mode sync`, fp32 (the exact butterfly)
    fp16 int8 fp4 lowrank topk   ours, each compression in its best measured mode (variants.py says which)
    default        ours with join's defaults (no mode or compression flag)

Link rates. A tiny model on CPU communicates little next to its compute, unlike a 1B model on a GPU, so
each lab setting stands for a stated GPU setting (gpu.py, every assumption a flag): its link rate is
chosen so that (fp32 ring all-reduce time of the model) / (round compute time) equals the GPU setting's.
Default: the `1b` preset on one H100 per peer (989 TFLOP/s bf16 x MFU 0.4, 2^19 tokens per step, H=100)
at 100 Mbit/s (ratio 0.60) and at 1 Gbit/s (0.060). The round compute time is the nocomm run's, measured
first with all 4 peers sharing the CPU as in every other run.

Per variant and setting: steady-state tokens/s per peer (rounds 1..R-2), utilization (vs nocomm), bytes
on the wire per peer per round (interface counters) and their ratio to an fp32 ring all-reduce of the
same parameters, final val loss, wall time, share of time waiting on communication, equal final hashes.
Then the all-reduce alone (allreduce.py): our exchange of a fixed pseudo-gradient per strategy, and gloo,
against the ideal ring time for the same payload. Shortcuts that keep the run under 30 minutes, each
recorded in the result's `notes`: DDP's val loss comes from one unshaped run at the first setting's
tokens (its math does not depend on the link) and its throughput per setting from --ddp-steps steps;
the second setting runs --rounds-second rounds; nocomm runs twice, for both settings.
Writes benchmarks/results/<name>.json, .png and .md.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import RESULTS, write_result  # noqa: E402
from benchmarks.netlab import NetLabError, check_available  # noqa: E402
from benchmarks.netns import allreduce, report  # noqa: E402
from benchmarks.netns.gpu import GpuSetting, lab_rate_mbit, ring_bytes  # noqa: E402
from benchmarks.netns.runner import GLOO_ON_LAB_LINK, run_peers  # noqa: E402
from benchmarks.netns.variants import VARIANTS, RunShape, Variant, mode_and_compression, outer_choice, peer_cmd  # noqa: E402

OURS = [name for name, v in VARIANTS.items() if v.kind == "ours"]
_RUNS = itertools.count()  # run directories are numbered in the order the runs start
STARTUP_ROUNDS = 4  # a run's start-up (imports, DHT, waiting for peers) costs about this many rounds of training


@dataclass
class Clock:
    """Progress: runs done, time spent, and a rough estimate of the rest (weights: rounds, start-up included)."""

    weights: dict[str, float]
    started: float = field(default_factory=time.monotonic)
    done: float = 0.0

    def tick(self, label: str, line: str) -> None:
        self.done += self.weights.pop(label)
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * sum(self.weights.values()) if self.done else float("nan")
        print(f"[{_clock(elapsed)} elapsed, about {_clock(left)} left] {label}: {line}", flush=True)


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s" if seconds == seconds else "?"


def settings(args: argparse.Namespace) -> list[GpuSetting]:
    return [
        GpuSetting(link_mbit=link, preset=args.gpu_preset, peak_tflops=args.gpu_peak_tflops, mfu=args.gpu_mfu,
                   tokens_per_step=args.gpu_tokens_per_step, inner_steps=args.gpu_inner_steps, peers=args.peers)
        for link in args.gpu_links
    ]  # fmt: skip


def run_variant(args: argparse.Namespace, variant: Variant, shape: RunShape, rate: float | None, tmp: Path) -> dict:
    """Train `variant` at `shape` on links of `rate` Mbit/s (None: unshaped); its summary (report.summarize)."""
    outer = outer_choice(variant, hivemind_lr=args.hivemind_outer_lr, hivemind_momentum=args.hivemind_outer_momentum)
    where = tmp / f"{next(_RUNS):02d}-{variant.name}@{rate or 'unshaped'}-{shape.rounds}r{shape.max_steps}s"
    dirs = [where / f"peer{h}" for h in range(shape.peers)]

    def cmd(lab, host: int) -> list[str]:
        return peer_cmd(shape, variant, outer, host=host, ip=lab.ip(host), leader_ip=lab.ip(0), run_dir=dirs[host])

    run = run_peers(cmd, peers=shape.peers, rate_mbit=rate, run_dirs=dirs, announces=variant.kind in ("ours", "hivemind"),
                    timeout=args.timeout, env=GLOO_ON_LAB_LINK)  # fmt: skip
    mode, compression, syncs = mode_and_compression(variant)
    summary = report.summarize(run, tokens_per_round=shape.tokens_per_round, ring_sent=_ring_sent(args), syncs=syncs,
                               shared=variant.kind != "nocomm")  # fmt: skip
    return {
        "kind": variant.kind, "mode": mode, "compression": compression,
        "outer_lr": outer.lr if outer else None, "outer_momentum": outer.momentum if outer else None,
        "outer_from": outer.source if outer else None, "why": variant.why, "rate_mbit": rate,
        "rounds": shape.rounds, "max_steps": shape.max_steps, **summary,
    }  # fmt: skip


def _ring_sent(args: argparse.Namespace) -> float:
    from dilocox_p2p.config import PRESETS
    from dilocox_p2p.model import unit_param_counts

    return ring_bytes(sum(unit_param_counts(PRESETS[args.preset])), args.peers)


def _line(r: dict) -> str:
    val = "-" if r["final_val_loss"] is None else f"{r['final_val_loss']:.4f}"
    return (f"{r['tokens_per_s']:8,.0f} tokens/s, {r['wire_bytes_per_peer_per_round'] / 1e6:7.3f} MB/round on the wire "
            f"({r['ratio_to_fp32_ring']:.4f} x fp32 ring), val {val}, waiting {100 * r['wait_share']:.0f}%, "
            f"hashes equal {r['hashes_equal']}")  # fmt: skip


def calibrate(
    args: argparse.Namespace, nocomm: dict, gpus: list[GpuSetting], shape: RunShape
) -> tuple[dict[str, float], float]:
    """Each GPU setting's lab link rate, from the nocomm run's round time; and that round time."""
    round_seconds = shape.tokens_per_round / nocomm["tokens_per_s"]
    from dilocox_p2p.config import PRESETS
    from dilocox_p2p.model import unit_param_counts

    params = sum(unit_param_counts(PRESETS[args.preset]))
    rates = {g.name: lab_rate_mbit(g, lab_params=params, lab_round_seconds=round_seconds) for g in gpus}
    print(f"calibration: a round of H={shape.inner_steps} takes {round_seconds:.2f} s with no communication; "
          f"{args.preset} has {params:,} parameters", flush=True)  # fmt: skip
    for g in gpus:
        print(f"  {g.name}: fp32 ring {g.fp32_ring_seconds:.1f} s / round {g.round_seconds:.1f} s = {g.ratio:.3f} "
              f"-> lab link {rates[g.name]:.2f} Mbit/s", flush=True)  # fmt: skip
    return rates, round_seconds


def run_all(args: argparse.Namespace, tmp: Path) -> dict:
    gpus = settings(args)
    base = RunShape(peers=args.peers, preset=args.preset, rounds=args.rounds, inner_steps=args.inner_steps,
                    batch_size=args.batch_size, warmup=args.warmup, gpu_inner_steps=args.gpu_inner_steps)  # fmt: skip
    shapes = {g.name: base if i == 0 else replace(base, rounds=args.rounds_second) for i, g in enumerate(gpus)}
    variants = [VARIANTS[v] for v in args.variants if v != "nocomm"]
    weights = {"nocomm (calibration)": STARTUP_ROUNDS + base.rounds}
    weights.update({f"nocomm (repeat {k})": STARTUP_ROUNDS + base.rounds for k in range(1, args.nocomm_repeats)})
    if "ddp-gloo" in args.variants:
        weights["ddp-gloo (loss run, unshaped)"] = STARTUP_ROUNDS + 1.5 * base.rounds
    for g in gpus:
        for v in variants:
            work = args.ddp_steps / base.inner_steps * (1 + g.ratio * base.inner_steps) if v.kind == "ddp" else (
                shapes[g.name].rounds * (1 + g.ratio))  # fmt: skip
            weights[f"{v.name} @ {g.name}"] = STARTUP_ROUNDS + work
    if args.allreduce_strategies:
        weights["all-reduce alone"] = 8 * STARTUP_ROUNDS
    clock = Clock(weights)

    nocomm_runs = [run_variant(args, VARIANTS["nocomm"], base, None, tmp)]
    clock.tick("nocomm (calibration)", _line(nocomm_runs[0]))
    rates, round_seconds = calibrate(args, nocomm_runs[0], gpus, base)
    ddp_loss = None
    if "ddp-gloo" in args.variants:
        ddp_loss = run_variant(args, VARIANTS["ddp-gloo"], base, None, tmp)
        clock.tick("ddp-gloo (loss run, unshaped)", _line(ddp_loss))
    results: dict[str, dict] = {}
    for i, g in enumerate(gpus):
        res = results[g.name] = {}
        for v in variants:
            shape = replace(shapes[g.name], max_steps=args.ddp_steps) if v.kind == "ddp" else shapes[g.name]
            res[v.name] = run_variant(args, v, shape, rates[g.name], tmp)
            if v.kind == "ddp" and ddp_loss is not None:
                _take_loss(res[v.name], ddp_loss, base)
            clock.tick(f"{v.name} @ {g.name}", _line(res[v.name]))
        for k in range(1, args.nocomm_repeats if i == 0 else 1):  # the machine's drift over the run, and its noise
            nocomm_runs.append(run_variant(args, VARIANTS["nocomm"], base, None, tmp))
            clock.tick(f"nocomm (repeat {k})", _line(nocomm_runs[-1]))
    nocomm = _merged(nocomm_runs, base)
    for name, res in results.items():
        results[name] = {"nocomm": dict(nocomm), **res}
        _ratios(results[name])
    rows = []
    if args.allreduce_strategies:
        rows = allreduce.measure(
            peers=args.peers, rate_mbit=args.allreduce_rate, preset=args.allreduce_preset, stages=args.allreduce_stages,
            strategies=args.allreduce_strategies, repeats=args.allreduce_repeats, tmp=tmp / "allreduce",
            exchange_timeout=300.0, timeout=args.timeout,
        )  # fmt: skip
        clock.tick("all-reduce alone", ", ".join(f"{r['strategy']} {r['seconds']:.2f} s ({r['vs_ideal']:.2f}x ideal)"
                                                 for r in rows))  # fmt: skip
    return {"gpus": gpus, "rates": rates, "round_seconds": round_seconds, "shapes": shapes, "results": results,
            "allreduce": rows, "ddp_loss_run": ddp_loss}  # fmt: skip


def _merged(runs: list[dict], base: RunShape) -> dict:
    """nocomm's result: the first run, with tokens/s the mean of all runs (each kept, to show the noise)."""
    rates = [r["tokens_per_s"] for r in runs]
    return {**runs[0], "tokens_per_s": sum(rates) / len(rates), "tokens_per_s_runs": rates,
            "notes": f"{len(runs)} run(s) (the first calibrated the links; the others after the first setting), "
                     f"tokens/s their mean; link-independent, so one set serves every setting; {base.rounds} rounds"}  # fmt: skip


def _take_loss(bounded: dict, loss_run: dict, base: RunShape) -> None:
    """DDP on a shaped link ran --ddp-steps steps (throughput); its loss and curve are the unshaped run's, whose
    curve is placed on this link's time axis by this link's throughput (`curve_projected`)."""
    bounded["final_val_loss"] = loss_run["final_val_loss"]
    tps = bounded["tokens_per_s"]
    bounded["curve_peer0"] = [((k + 1) * base.tokens_per_round / tps, v) for k, (_, v) in enumerate(loss_run["curve_peer0"])]
    bounded["curve_projected"] = True
    bounded["wall_projected_s"] = base.rounds * base.tokens_per_round / tps
    bounded["notes"] = (f"throughput, wire bytes and waiting from {bounded['max_steps']} steps on this link; val loss "
                        f"from the unshaped run of {base.rounds} rounds (the same math)")  # fmt: skip


def _ratios(res: dict) -> None:
    """utilization = tokens/s / nocomm's; speedup over ddp-gloo against the ideal speedup (nocomm / ddp)."""
    nocomm = res["nocomm"]["tokens_per_s"]
    ddp = res.get("ddp-gloo", {}).get("tokens_per_s")
    for r in res.values():
        r["utilization"] = r["tokens_per_s"] / nocomm
        r["speedup_vs_ddp"] = r["tokens_per_s"] / ddp if ddp else None
        r["ideal_speedup_vs_ddp"] = nocomm / ddp if ddp else None
        r["speedup_vs_ideal"] = r["speedup_vs_ddp"] / r["ideal_speedup_vs_ddp"] if ddp else None


def notes(args: argparse.Namespace, out: dict) -> list[str]:
    gpus, shapes = out["gpus"], out["shapes"]
    lines = [
        f"ddp-gloo: val loss and curve from one unshaped run of {args.rounds} rounds (DDP's math does not depend on "
        f"the link); throughput, wire bytes and waiting per setting from {args.ddp_steps} steps on that link "
        "(without the validation passes ours runs every round, which favours DDP slightly)",
        "ddp-gloo all-reduces every inner step: the lab's per-step ratio is the round ratio x the lab's H "
        f"({args.inner_steps}), not the GPU setting's H ({args.gpu_inner_steps}): DDP would be slower still there "
        "(`ddp_slowdown` per GPU setting: no-comm / DDP throughput if nothing overlaps)",
        f"nocomm runs {args.nocomm_repeats} time(s) (link-independent) and serves every setting: the first run "
        "calibrates the links, the utilization is against the mean of all (`tokens_per_s_runs` shows the spread)",
        "ours' compressed messages ride the compressed butterfly (a member sends about 2 (N-1)/N of its message; "
        "topk all-gathered in groups of up to 3)",
        "the lab's communication takes CPU from training on the same 2 cores (helpers, codecs); a GPU peer's CPU is spare",
        "tc tbf shapes bandwidth only: no latency is added (netem is absent)",
        f"streaming's tau is join's default at the GPU setting's H (min(5, H/P) of {args.gpu_inner_steps} steps), scaled "
        f"to the lab's H ({args.inner_steps}): {shapes[gpus[0].name].overlap_steps(1)} step(s), so that a round hides the same share of its "
        "exchange as on the GPUs (join's own default, 5 of the lab's H, would hide 5x more)",
    ]
    lines += [f"{g.name}: {shapes[g.name].rounds} rounds" for g in gpus[1:] if shapes[g.name].rounds != args.rounds]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.netns", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--peers", type=int, default=4, help="peers, each in its own network namespace")
    p.add_argument("--preset", default="tiny", help="the lab's model preset (1 pipeline stage per peer)")
    p.add_argument("--rounds", type=int, default=8, help="rounds of the first setting (steady state: rounds 1..R-2)")
    p.add_argument("--rounds-second", type=int, default=5, help="rounds of the other settings")
    p.add_argument("--inner-steps", type=int, default=20, help="H of the lab runs")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per inner step per peer")
    p.add_argument("--warmup", type=int, default=50, help="inner lr warm-up steps")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="what runs (nocomm always runs: it calibrates the links)")  # fmt: skip
    p.add_argument("--nocomm-repeats", type=int, default=2, help="nocomm runs: the first calibrates the links, the "
                   "others run after the first setting; utilization is against their mean tokens/s")  # fmt: skip
    p.add_argument("--ddp-steps", type=int, default=8, help="ddp-gloo's inner steps per shaped setting (throughput)")
    p.add_argument("--hivemind-outer-lr", type=float, default=0.7, help="hivemind-fp16's outer lr (OpenDiLoCo)")
    p.add_argument("--hivemind-outer-momentum", type=float, default=0.9, help="hivemind-fp16's outer momentum")
    g = p.add_argument_group("GPU settings the lab stands for (gpu.py)")
    g.add_argument("--gpu-links", type=float, nargs="+", default=[100.0, 1000.0], help="link rates, Mbit/s, one setting each")
    g.add_argument("--gpu-preset", default="1b", help="model preset on the GPUs")
    g.add_argument("--gpu-peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100 SXM: 989)")
    g.add_argument("--gpu-mfu", type=float, default=0.4, help="model FLOPs utilization assumed")
    g.add_argument("--gpu-tokens-per-step", type=int, default=2**19, help="tokens per inner step per peer")
    g.add_argument("--gpu-inner-steps", type=int, default=100, help="H on the GPUs")
    a = p.add_argument_group("the all-reduce alone (allreduce.py)")
    a.add_argument("--allreduce-rate", type=float, default=100.0, help="link rate, Mbit/s")
    a.add_argument("--allreduce-preset", default="small", help="the pseudo-gradient has this preset's stage-0 shapes")
    a.add_argument("--allreduce-stages", type=int, default=2, help="... split into this many stages")
    a.add_argument("--allreduce-repeats", type=int, default=3, help="timed exchanges per strategy (after one warm-up)")
    a.add_argument("--allreduce-strategies", nargs="*", default=[*allreduce.STRATEGIES, "gloo"],
                   choices=[*allreduce.STRATEGIES, "gloo"], help="none = fp32; gloo = gloo all_reduce; empty: skip")  # fmt: skip
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one run may take")
    p.add_argument("--smoke", action="store_true", help="a short check of everything: 3 rounds of H=10, 4 DDP steps, "
                   "the all-reduce of the tiny model once; writes <name>_smoke")  # fmt: skip
    p.add_argument("--keep", metavar="DIR", help="keep the peers' run dirs and logs here (default: a temp dir)")
    p.add_argument("--name", default="netns", help="result file name under benchmarks/results/")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds = args.rounds_second = 3
        args.inner_steps, args.ddp_steps, args.warmup = 10, 4, 10
        args.allreduce_preset, args.allreduce_stages, args.allreduce_repeats = "tiny", 1, 1
        args.name = f"{args.name}_smoke"
    if min(args.rounds, args.rounds_second) < 3:
        p.error("--rounds and --rounds-second must be at least 3: the steady state is rounds 1..R-2")
    return args


def preflight(args: argparse.Namespace) -> None:
    """One line naming the fix for what is missing: root and iproute2, numpy<2, working hivemind fp16 averaging."""
    import numpy

    try:
        check_available()
    except NetLabError as e:
        raise SystemExit(f"benchmarks.netns: {e}; run `sudo .venv/bin/python -m benchmarks.netns`") from None
    if int(numpy.__version__.split(".")[0]) >= 2:
        raise SystemExit(f"benchmarks.netns: numpy {numpy.__version__}: hivemind's codecs need numpy<2 (pip install 'numpy<2')")
    if "hivemind-fp16" in args.variants:
        from benchmarks.netns.baselines import check_fp16

        print(f"hivemind fp16 averaging on loopback: error vs the true mean {check_fp16():.1e} of the largest value")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preflight(args)
    for signum in (signal.SIGTERM, signal.SIGINT):  # the network lab is torn down on the way out
        signal.signal(signum, _exit_cleanly)
    with tempfile.TemporaryDirectory(prefix="netns-bench-") as tmp:
        out = run_all(args, Path(args.keep or tmp).resolve())
    gpus = out["gpus"]
    first = gpus[0].name
    payload = {
        "command_line": " ".join(["python -m benchmarks.netns", *sys.argv[1:]]),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "settings": {
            "gpu": [g.describe() for g in gpus], "lab_rates_mbit": out["rates"],
            "rounds": {name: s.rounds for name, s in out["shapes"].items()},
            "lab": {"preset": args.preset, "stages": 1, "inner_steps": args.inner_steps, "batch_size": args.batch_size,
                    "fp32_ring_bytes_per_peer": _ring_sent(args), "tokens_per_round": out["shapes"][first].tokens_per_round,
                    "round_seconds_no_comm": out["round_seconds"],
                    "fp32_ring_seconds": {g.name: out["round_seconds"] * g.ratio for g in gpus}},
            "link": "tc tbf at the lab rate, each way per peer, no added latency",
        },
        "results": out["results"],
        "ddp_loss_run": out["ddp_loss_run"],
        "allreduce": out["allreduce"],
        "targets": report.targets(out["results"], out["allreduce"], first=first,
                                  ours=[v for v in OURS if v in args.variants]),
        "notes": notes(args, out),
    }  # fmt: skip
    png, md = RESULTS / f"{args.name}.png", RESULTS / f"{args.name}.md"
    RESULTS.mkdir(parents=True, exist_ok=True)
    title = (f"{args.peers} peers, {args.preset}, 1 stage, H={args.inner_steps}, batch {args.batch_size}, equal tokens; "
             "lab links matched to: " + "; ".join(f"{g.name} ({out['rates'][g.name]:.2f} Mbit/s)" for g in gpus))  # fmt: skip
    report.plot(out["results"], _ring_sent(args), png, title)
    md.write_text(report.markdown(payload))
    path = write_result(args.name, {**payload, "plot": png.name, "table": md.name})
    print(md.read_text())
    print(f"wrote {path}, {png} and {md}")
    return 0


def _exit_cleanly(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
