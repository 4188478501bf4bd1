#!/usr/bin/env python3
"""A model of the DiLoCoX setting (107B, 1 Gbit/s, D peers x M stages): DDP all-reduce vs ours.

    python benchmarks/project.py                                   # the paper's setting, defaults below
    python benchmarks/project.py --grad-dtype fp32 --tokens-per-step 16384 --name project_fp32
    python benchmarks/project.py --mode streaming --fragments 2 --overlap-steps 5

Pure arithmetic: nothing is trained or sent. It projects this project's measured figures
(compression ratio and codec seconds, the throughput kept while the exchange runs in the
background, the all-reduce's time against an ideal ring) onto the DiLoCoX paper's setting, and
sets the result beside the paper's 357x. Every figure that is neither measured here nor found in
the paper is a named assumption with a flag; the JSON lists each input with its source.

The paper, as far as its public text could be read here (quotes and addresses in PAPER below):
107B model, 1 Gbit/s, 357x over "vanilla AllReduce", A800 GPUs, 160 GPUs over 20 nodes, and an
example layout of PP = 8 per cluster. Its local steps H, batch, sequence length, compression
ratio, the layout of the 107B run and how the 357x was computed were not found: they are
assumptions here (--inner-steps, --tokens-per-step, --peers, --stages, ...).

The model. A peer is one cluster: M pipeline stages of g GPUs each, one WAN link of B bytes/s
each way (shared by its M stage workers; --link-scope stage gives each stage its own). D peers.
N parameters, T tokens per inner step per peer, peak F FLOP/s per GPU at utilization u:
  compute of one inner step   C = 6 N T / (M g F u)
  DDP, every inner step: ring all-reduce of all gradients (b bytes a value; a peer's g GPUs of a
  stage reduce over their fast local links first), A = 2 (D-1)/D x b N / B x e_ddp
      not overlapped: C + A;  overlapped with backward: (1-k) C + max(k C, A), k = backward share
  ours, every H inner steps: one exchange of the pseudo-gradient, E = transfer x e_ours + decode
      fp32 (`none`): the butterfly, 2 (D-1)/D x 4 N / B
      compressed: all-gathered (a member sends its message D-1 times), (D-1) x (4 N / r) / B,
      r = fp32 size / message size (measured), so the ratio to the fp32 ring is r x 2/D
      wall per round = max(H C + P max(0, E/P - W), E) + encode + s H C
        delayed (DiLoCoX's one-step delay): P = 1, W = H C: the exchange hides behind the round
        streaming: P fragments, each exchange hidden behind tau inner steps, W = tau C
        s = the measured share of compute lost while exchanges run in the background
  tokens/s = D T x steps / wall; utilization = compute seconds / wall seconds; speedup = ours / DDP.
Measured inputs (each with its file and field in the JSON; a missing file gives a flagged default):
r, encode and decode seconds per parameter from compression.json (the `small` preset on a 2-core
CPU: low-rank's ratio grows with matrix width, so 107B would compress more at the same rank);
the throughput kept while exchanging, from overlap.json (delayed vs no averaging), else netns.json's
low-rank `utilization` (which also pays the codec the model adds from compression.json); e_ours from netns.json's `allreduce_vs_ideal` if present,
else modes.json (sync fp32 on its slowest link: waiting per sync / ideal transfer).
Left out: latency (messages are GBs), stragglers, failures, memory fit (not checked), and
quality: DiLoCo-style training reaches a given loss in more tokens than DDP (the JSON carries
this project's measured loss gaps at equal tokens beside the throughput).

Writes benchmarks/results/<name>.json (via common.write_result) and <name>.png.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, write_result  # noqa: E402
from benchmarks.project_inputs import Figure, Measured, load_measured  # noqa: E402
from benchmarks.project_model import (  # noqa: E402
    FP32,
    Baseline,
    Cluster,
    Compute,
    Overlap,
    Strategy,
    all_gather_seconds,
    ddp_allreduce_seconds,
    ddp_step_seconds,
    exchange_seconds,
    ours_round,
    ratio_vs_fp32_ring,
    ring_allreduce_seconds,
    round_wall_seconds,
    step_compute_seconds,
)

__all__ = [
    "FP32", "Cluster", "Compute", "Baseline", "Overlap", "Strategy", "Figure", "Measured",
    "ring_allreduce_seconds", "all_gather_seconds", "step_compute_seconds", "ddp_step_seconds",
    "ddp_allreduce_seconds", "exchange_seconds", "round_wall_seconds", "ours_round", "ratio_vs_fp32_ring", "project",
    "tokens_for_speedup", "sweep", "load_measured",
]  # fmt: skip

ARXIV = "https://arxiv.org/abs/2506.21263"
PAPER: dict[str, Any] = {
    "title": "DiLoCoX: A Low-Communication Large-Scale Training Framework for Decentralized Cluster",
    "arxiv": ARXIV,
    "found": [
        {"claim": "107B model, 1 Gbit/s, 357x over vanilla AllReduce",
         "quote": "we demonstrate that DiLoCoX is capable of pre-training a 107B foundation model over a 1Gbps "
                  "network. Compared to vanilla AllReduce, DiLoCoX can achieve a 357x speedup in distributed "
                  "training while maintaining negligible degradation in model convergence.",
         "source": "abstract, https://arxiv.org/html/2506.21263v1"},
        {"claim": "example layout: clusters of PP = 8 x DP = 2, H local steps between outer steps",
         "quote": "The example infrastructure comprises 32 workers distributed among 2 decentralized clusters, "
                  "with 16 workers in each cluster. [...] Two clusters are trained independently for H steps "
                  "respectively. The parallel strategy is PP = 8, DP = 2 for each cluster",
         "source": "Figure 1 caption, quoted by https://chatpaper.com/paper/155787 and "
                   "https://liner.com/review/dilocox-lowcommunication-largescale-training-framework-for-decentralized-cluster"},
        {"claim": "compression: quantization + low rank, adaptive together with the local steps",
         "quote": "an Adaptive Gradient Compression scheme combining Quantization and Low-Rank methods, "
                  "dynamically adjusting compression and local training s[teps]",
         "source": "third-party summary (cut off there): https://liner.com/review/dilocox-lowcommunication-"
                   "largescale-training-framework-for-decentralized-cluster"},
        {"claim": "the 107B run: a modified Qwen1.5-107B, 160 GPUs over 20 nodes",
         "quote": "It trained a modified Qwen1.5-107B across 160 GPUs spread over 20 nodes, achieved 357x better "
                  "communication efficiency than standard AllReduce",
         "source": "the authors' company blog, https://0g.ai/blog/dilocox-107b-decentralized-ai-training"},
        {"claim": "GPUs: NVIDIA A800",
         "quote": "DiLoCoX instead lets clusters of NVIDIA A800 GPUs work semi-independently",
         "source": "press, https://cryptobriefing.com/0g-107b-decentralized-model-china-mobile/"},
    ],
    "not_found": [
        "H (local steps) of the 107B run", "batch size and sequence length", "the compression ratio used",
        "D and M of the 107B run (only the Figure 1 example, PP = 8, DP = 2 per cluster)",
        "how the 357x was computed (the abstract says 'speedup in distributed training'; the blog says "
        "'communication efficiency'), and the baseline's gradient precision and overlap",
    ],
}


# ----- projection, sweeps, plot ---------------------------------------------------------------


def project(cluster: Cluster, compute: Compute, baseline: Baseline, overlap: Overlap,
            strategies: tuple[Strategy, ...]) -> dict[str, Any]:  # fmt: skip
    """Tokens/s, utilization and speedup of DDP (both ways) and of ours with each strategy."""
    c = step_compute_seconds(cluster, compute)
    ddp = {}
    for label, overlapped in (("not_overlapped", False), ("overlapped", True)):
        step = ddp_step_seconds(cluster, compute, baseline, overlapped=overlapped)
        ddp[label] = {"step_s": step, "tokens_per_s": cluster.peers * compute.tokens_per_step / step,
                      "utilization": c / step}  # fmt: skip
    ours = {}
    for s in strategies:
        rnd = ours_round(s, cluster, compute, overlap)
        tps = cluster.peers * compute.tokens_per_step * compute.inner_steps / rnd["wall_s"]
        ours[s.name] = {
            **rnd, "tokens_per_s": tps, "utilization": rnd["compute_s"] / rnd["wall_s"],
            "exchange_hidden": rnd["exchange_s"] <= _window(overlap, compute, c),
            "ratio_vs_fp32_ring": ratio_vs_fp32_ring(s, cluster.peers),
            "speedup_vs_ddp": tps / ddp["overlapped"]["tokens_per_s"],
            "speedup_vs_ddp_not_overlapped": tps / ddp["not_overlapped"]["tokens_per_s"],
        }  # fmt: skip
    return {"step_compute_s": c, "ddp_allreduce_s": ddp_allreduce_seconds(cluster, baseline), "ddp": ddp, "ours": ours}


def _window(overlap: Overlap, compute: Compute, c: float) -> float:
    if overlap.mode == "streaming":
        return overlap.fragments * overlap.overlap_steps * c
    return compute.inner_steps * c


def sweep(field_name: str, values: list[float], cluster: Cluster, *args: Any) -> list[dict[str, Any]]:
    """The speedup of each strategy over the overlapped DDP at each value of one Cluster field."""
    rows = []
    for v in values:
        changed = replace(cluster, **{field_name: type(getattr(cluster, field_name))(v)})
        r = project(changed, *args)
        rows.append({field_name: v, "ddp_tokens_per_s": r["ddp"]["overlapped"]["tokens_per_s"],
                     "speedup_vs_ddp": {k: o["speedup_vs_ddp"] for k, o in r["ours"].items()},
                     "utilization": {k: o["utilization"] for k, o in r["ours"].items()}})  # fmt: skip
    return rows


def tokens_for_speedup(target: float, strategy: Strategy, cluster: Cluster, compute: Compute, baseline: Baseline,
                       overlap: Overlap) -> dict[str, Any]:  # fmt: skip
    """The largest tokens per inner step (on a log grid, 1e2..1e8) at which ours reaches `target` x the
    overlapped DDP, and the speedup's ceiling as the step shrinks: H A / (E + encode), both sides link-bound."""
    grid = [round(10 ** (2 + i / 40)) for i in range(0, 6 * 40 + 1)]
    reached = [t for t in grid if _speedup(strategy, cluster, replace(compute, tokens_per_step=t), baseline, overlap)
               >= target]  # fmt: skip
    rnd = ours_round(strategy, cluster, compute, overlap)
    ceiling = compute.inner_steps * ddp_allreduce_seconds(cluster, baseline) / (rnd["exchange_s"] + rnd["encode_s"])
    return {"target": target, "largest_tokens_per_step_reaching_it": max(reached) if reached else None,
            "ceiling_as_the_step_shrinks": ceiling}  # fmt: skip


def _speedup(strategy: Strategy, cluster: Cluster, compute: Compute, baseline: Baseline, overlap: Overlap) -> float:
    return project(cluster, compute, baseline, overlap, (strategy,))["ours"][strategy.name]["speedup_vs_ddp"]


def plot(bandwidth_rows: list[dict], peer_rows: list[dict], paper_speedup: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for ax, rows, x in ((left, bandwidth_rows, "link_gbit"), (right, peer_rows, "peers")):
        for name in rows[0]["speedup_vs_ddp"]:
            ax.plot([r[x] for r in rows], [r["speedup_vs_ddp"][name] for r in rows], marker="o", label=name)
        ax.axhline(paper_speedup, color="k", linestyle="--", label=f"paper: {paper_speedup:g}x")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylabel("tokens/s of ours / DDP (all-reduce overlapped with backward)")
    left.set_xscale("log")
    left.set_xlabel("WAN link per peer, Gbit/s")
    left.set_title("speedup vs bandwidth")
    right.set_xlabel("peers D (at the default link)")
    right.set_title("speedup vs number of peers")
    left.legend(fontsize=7)
    fig.suptitle("DiLoCoX setting, projected from this project's measured figures (benchmarks/project.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----- CLI ------------------------------------------------------------------------------------


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default in --help."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Formatter)
    a = p.add_argument
    cl, co, ba, ov = Cluster(), Compute(), Baseline(), Overlap()  # the defaults (slotted classes keep none)
    a("--params", type=float, default=cl.params, help="N, model parameters (paper: 107e9)")
    a("--peers", type=int, default=cl.peers, help="D, peers averaging (assumption: the 0G blog's 160 GPUs / 8 stages)")
    a("--stages", type=int, default=cl.stages, help="M, pipeline stages per peer (the paper's Figure 1 example: 8)")
    a("--gpus-per-stage", type=int, default=cl.gpus_per_stage,
      help="g, GPUs per stage inside a peer, data-parallel over fast local links (assumption; Figure 1's cluster: 2)")
    a("--link-gbit", type=float, default=cl.link_gbit, help="WAN link per peer, Gbit/s each way (paper: 1)")
    a("--link-scope", choices=["peer", "stage"], default=cl.link_scope,
      help="peer: a peer's M stage workers share one link; stage: each has its own (assumption)")
    a("--peak-tflops", type=float, default=co.peak_tflops, help="bf16 dense TFLOP/s peak per GPU (A800/A100 312, H100 SXM 989; datasheets)")
    a("--mfu", type=float, default=co.mfu, help="model FLOPs utilization of the pipeline, bubbles included (assumption)")
    a("--tokens-per-step", type=int, default=co.tokens_per_step, help="T, tokens per inner step per peer (assumption: 32 x 2048; the paper's not found)")
    a("--inner-steps", type=int, default=co.inner_steps, help="H, inner steps per round (assumption: DiLoCo's default; the paper's not found)")
    a("--backward-share", type=float, default=co.backward_share,
      help="backward's share of a step's compute (DDP's overlap window)")
    a("--grad-dtype", choices=["bf16", "fp32"], default="bf16", help="the gradients DDP all-reduces (assumption: the paper's baseline precision not found)")
    a("--ddp-efficiency", type=float, default=ba.efficiency,
      help="DDP all-reduce seconds / ideal ring seconds (1: ideal, the baseline at its best)")
    a("--mode", choices=["delayed", "streaming"], default=ov.mode, help="how ours hides its exchange: delayed (DiLoCoX) or streaming (Streaming DiLoCo)")
    a("--fragments", type=int, default=ov.fragments, help="P, streaming fragments")
    a("--overlap-steps", type=int, default=ov.overlap_steps, help="tau, steps a streaming exchange may take")
    a("--codec-speedup", type=float, default=ov.codec_speedup,
      help="codec speed relative to compression.json's machine (1: as measured, on its 2-core CPU)")
    a("--utilization", type=float, help="override the measured share of throughput kept while exchanging (default: measured)")
    a("--allreduce-vs-ideal", type=float, help="override the measured exchange seconds / ideal seconds (default: measured)")
    a("--assumed-ratio", type=float, nargs="*", default=[],
      help="also project hypothetical all-gathered strategies of these fp32/message ratios (no codec cost)")
    a("--headline", default="lowrank (default", help="the strategy reported beside the paper (a name prefix)")
    a("--paper-speedup", type=float, default=357.0, help="the paper's speedup over vanilla AllReduce")
    a("--bandwidths", type=float, nargs="+", default=[0.1, 0.2, 0.5, 1, 2, 5, 10], help="Gbit/s values swept")
    a("--peer-counts", type=int, nargs="+", default=[2, 4, 8, 10, 16, 20, 32, 64], help="D values swept")
    a("--results-dir", type=Path, default=RESULTS, help="where the measured inputs are read from")
    a("--name", default="project", help="result file name under benchmarks/results/")
    return p


def _configs(args: argparse.Namespace, measured: Measured) -> tuple[Cluster, Compute, Baseline, Overlap]:
    cluster = Cluster(params=args.params, peers=args.peers, stages=args.stages, gpus_per_stage=args.gpus_per_stage,
                      link_gbit=args.link_gbit, link_scope=args.link_scope)  # fmt: skip
    compute = Compute(peak_tflops=args.peak_tflops, mfu=args.mfu, tokens_per_step=args.tokens_per_step,
                      inner_steps=args.inner_steps, backward_share=args.backward_share)  # fmt: skip
    baseline = Baseline(grad_bytes={"bf16": 2, "fp32": 4}[args.grad_dtype], efficiency=args.ddp_efficiency)
    overlap = Overlap(
        mode=args.mode, fragments=args.fragments, overlap_steps=args.overlap_steps, codec_speedup=args.codec_speedup,
        utilization=args.utilization if args.utilization is not None else measured.utilization.value,
        allreduce_vs_ideal=args.allreduce_vs_ideal if args.allreduce_vs_ideal is not None
        else measured.allreduce_vs_ideal.value,
    )  # fmt: skip
    return cluster, compute, baseline, overlap


def _inputs(args: argparse.Namespace, measured: Measured) -> dict[str, Any]:
    def figure(f: Figure, override: float | None) -> dict[str, Any]:
        if override is not None:
            return {"value": override, "source": "--flag override", "measured": False, "measured_value": f.value}
        return asdict(f)

    return {
        "utilization": figure(measured.utilization, args.utilization),
        "allreduce_vs_ideal": figure(measured.allreduce_vs_ideal, args.allreduce_vs_ideal),
        "strategies": [asdict(s) for s in measured.strategies],
        "notes": list(measured.notes),
        "not_used": "inner_throughput.json (tokens/s of the `tiny` model on 2 CPU cores) does not transfer to "
                    "107B on A800s: compute comes from --peak-tflops x --mfu instead",
    }  # fmt: skip


def _print_table(result: dict[str, Any], beside: dict[str, Any]) -> None:
    print(f"one inner step {result['step_compute_s']:.1f} s compute; DDP all-reduce {result['ddp_allreduce_s']:.0f} s")
    print(f"{'scheme':44s} {'tokens/s':>10s} {'util':>6s} {'vs fp32 ring':>12s} {'speedup':>9s}")
    for label, d in result["ddp"].items():
        print(f"{'DDP all-reduce, ' + label.replace('_', ' '):44s} {d['tokens_per_s']:10.1f} {d['utilization']:6.1%}")
    for name, o in result["ours"].items():
        print(f"{'ours: ' + name:44.44s} {o['tokens_per_s']:10.1f} {o['utilization']:6.1%} "
              f"{o['ratio_vs_fp32_ring']:11.1f}x {o['speedup_vs_ddp']:8.1f}x")  # fmt: skip
    print(f"beside the paper: {beside['strategy']} {beside['model_speedup']:.1f}x vs DDP overlapped "
          f"({beside['model_speedup_not_overlapped']:.1f}x not overlapped); paper {beside['paper_speedup']:g}x; "
          f"model reaches it at <= {beside['tokens_for_paper_speedup']['largest_tokens_per_step_reaching_it']} "
          f"tokens per inner step per peer")  # fmt: skip


def _run(args: argparse.Namespace, measured: Measured) -> dict[str, Any]:
    """Everything the result holds but the environment; ValueError for a flag outside its range."""
    cluster, compute, baseline, overlap = _configs(args, measured)
    strategies = measured.strategies + tuple(
        Strategy(name=f"assumed {r:g}x message", message_ratio=r, all_gather=True, source="--assumed-ratio")
        for r in args.assumed_ratio
    )  # fmt: skip
    configs = (compute, baseline, overlap, strategies)
    result = project(cluster, *configs)
    headline = next((s for s in strategies if s.name.startswith(args.headline)), strategies[-1])
    o = result["ours"][headline.name]
    beside = {
        "strategy": headline.name, "paper_speedup": args.paper_speedup,
        "model_speedup": o["speedup_vs_ddp"], "model_speedup_not_overlapped": o["speedup_vs_ddp_not_overlapped"],
        "model_over_paper": o["speedup_vs_ddp"] / args.paper_speedup, "exchange_hidden": o["exchange_hidden"],
        "tokens_for_paper_speedup": tokens_for_speedup(args.paper_speedup, headline, cluster, *configs[:3]),
    }  # fmt: skip
    return {
        "paper": PAPER,
        "assumptions": {"cluster": asdict(cluster), "compute": asdict(compute), "baseline": asdict(baseline),
                        "overlap": asdict(overlap), "model": __doc__.split("The model.", 1)[1].split("Writes", 1)[0]},
        "inputs": _inputs(args, measured),
        "result": result, "beside_paper": beside,
        "sweeps": {"link_gbit": sweep("link_gbit", args.bandwidths, cluster, *configs),
                   "peers": sweep("peers", args.peer_counts, cluster, *configs)},
        "quality_at_equal_tokens": measured.quality,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    measured = load_measured(args.results_dir)
    try:
        payload = _run(args, measured)
    except ValueError as exc:
        parser.error(str(exc))
    png = RESULTS / f"{args.name}.png"
    plot(payload["sweeps"]["link_gbit"], payload["sweeps"]["peers"], args.paper_speedup, png)
    path = write_result(args.name, {**payload, "plot": png.name})
    _print_table(payload["result"], payload["beside_paper"])
    for note in measured.notes:
        print(f"note: {note}")
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
