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
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import RESULTS, write_result  # noqa: E402

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


# ----- assumptions ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    params: float = 107e9
    """N, model parameters (the paper's 107B)."""
    peers: int = 20
    """D, peers (clusters) averaging; 160 GPUs over 20 nodes (0G blog) read as one peer per node."""
    stages: int = 8
    """M, pipeline stages per peer (the paper's Figure 1: PP = 8)."""
    gpus_per_stage: int = 1
    """g, GPUs per stage inside a peer (data-parallel over fast local links; Figure 1's cluster: 2)."""
    link_gbit: float = 1.0
    """B, WAN link of a peer in Gbit/s, each way (the paper's 1 Gbit/s)."""
    link_scope: Literal["peer", "stage"] = "peer"
    """peer: the M stage workers share the peer's one link; stage: each stage worker has its own."""

    def __post_init__(self) -> None:
        _check(self.params > 0 and self.peers >= 2 and self.stages >= 1 and self.gpus_per_stage >= 1,
               "need params > 0, peers >= 2, stages >= 1, gpus_per_stage >= 1")  # fmt: skip
        _check(self.link_gbit > 0 and self.link_scope in ("peer", "stage"), "need link_gbit > 0, scope peer|stage")

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbit * 1e9 / 8

    @property
    def values_per_link(self) -> float:
        """Parameters whose traffic crosses one link: all N, or one stage's share."""
        return self.params / (self.stages if self.link_scope == "stage" else 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Compute:
    peak_tflops: float = 312.0
    """F, bf16 dense peak per GPU (NVIDIA A100/A800 datasheet; H100 SXM: 989)."""
    mfu: float = 0.35
    """u, model FLOPs utilization of the pipeline, bubbles included (assumption, not from the paper)."""
    tokens_per_step: int = 65536
    """T, tokens per inner step per peer (assumption: e.g. 32 sequences of 2048; the paper's not found)."""
    inner_steps: int = 500
    """H, inner steps per round (DiLoCo's published default; the paper's H not found)."""
    backward_share: float = 2 / 3
    """k, backward's share of a step's FLOPs (4N of 6N per token): what DDP can overlap its all-reduce with."""

    def __post_init__(self) -> None:
        _check(self.peak_tflops > 0 and 0 < self.mfu <= 1 and 0 <= self.backward_share <= 1,
               "need peak_tflops > 0, 0 < mfu <= 1, 0 <= backward_share <= 1")  # fmt: skip
        _check(self.tokens_per_step > 0 and self.inner_steps >= 1, "need tokens_per_step > 0, inner_steps >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Baseline:
    grad_bytes: int = 2
    """b, bytes per gradient value DDP all-reduces (bf16 = 2, fp32 = 4)."""
    efficiency: float = 1.0
    """e_ddp, DDP all-reduce seconds / ideal ring seconds (1.0: an ideal ring, the baseline at its best)."""

    def __post_init__(self) -> None:
        _check(self.grad_bytes > 0 and self.efficiency >= 1.0, "need grad_bytes > 0, efficiency >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Overlap:
    mode: Literal["delayed", "streaming"] = "delayed"
    """delayed: hidden behind the whole round (DiLoCoX); streaming: each fragment behind tau steps."""
    fragments: int = 1
    """P, fragments per round (streaming)."""
    overlap_steps: int = 5
    """tau, inner steps a streaming fragment's exchange may take (the project's default)."""
    utilization: float = 1.0
    """Share of compute throughput kept while exchanges run in the background (measured)."""
    allreduce_vs_ideal: float = 1.0
    """e_ours, our exchange's seconds / ideal seconds for its payload (measured)."""
    codec_speedup: float = 1.0
    """How much faster the codec runs than measured on the benchmark machine (1: as measured, on CPU)."""

    def __post_init__(self) -> None:
        _check(self.mode in ("delayed", "streaming") and self.fragments >= 1 and self.overlap_steps >= 1,
               "need mode delayed|streaming, fragments >= 1, overlap_steps >= 1")  # fmt: skip
        _check(0 < self.utilization <= 1 and self.allreduce_vs_ideal >= 1 and self.codec_speedup > 0,
               "need 0 < utilization <= 1, allreduce_vs_ideal >= 1, codec_speedup > 0")  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    name: str
    message_ratio: float
    """r, fp32 bytes / message bytes (both low-rank phases counted)."""
    all_gather: bool
    """True: compressed messages, all-gathered; False: fp32 through the butterfly."""
    encode_s_per_param: float = 0.0
    """Encode seconds per parameter (blocks training at the round boundary)."""
    background_s_per_param_member: float = 0.0
    """Decode (and low-rank phase 2) seconds per parameter per group member (runs with the exchange)."""
    source: str = ""


FP32 = Strategy(name="none (fp32, butterfly)", message_ratio=1.0, all_gather=False, source="fp32 reference")


def _check(ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(rule)


# ----- the model ------------------------------------------------------------------------------


def ring_allreduce_seconds(payload_bytes: float, members: int, bytes_per_s: float) -> float:
    """Ideal ring (or butterfly) all-reduce: each member sends and receives 2 (n-1)/n of the payload."""
    return 2 * (members - 1) / members * payload_bytes / bytes_per_s


def all_gather_seconds(message_bytes: float, members: int, bytes_per_s: float) -> float:
    """All-gather: each member sends its message to the n-1 others (and receives theirs, full duplex)."""
    return (members - 1) * message_bytes / bytes_per_s


def step_compute_seconds(cluster: Cluster, compute: Compute) -> float:
    """C: one inner step of a peer, 6 N FLOPs a token spread over its M x g GPUs."""
    flops = 6 * cluster.params * compute.tokens_per_step
    return flops / (cluster.stages * cluster.gpus_per_stage * compute.peak_tflops * 1e12 * compute.mfu)


def ddp_allreduce_seconds(cluster: Cluster, baseline: Baseline) -> float:
    """A: one step's gradient all-reduce over a peer's link (its stage groups' rings all cross it)."""
    payload = cluster.values_per_link * baseline.grad_bytes
    return ring_allreduce_seconds(payload, cluster.peers, cluster.link_bytes_per_s) * baseline.efficiency


def ddp_step_seconds(cluster: Cluster, compute: Compute, baseline: Baseline, *, overlapped: bool) -> float:
    """Wall seconds of one DDP step: compute then all-reduce, or the all-reduce hidden behind backward."""
    c, a = step_compute_seconds(cluster, compute), ddp_allreduce_seconds(cluster, baseline)
    if not overlapped:
        return c + a
    return (1 - compute.backward_share) * c + max(compute.backward_share * c, a)


def exchange_seconds(strategy: Strategy, cluster: Cluster, overlap: Overlap) -> float:
    """E: one round's exchange over a peer's link (transfer x measured efficiency + background codec)."""
    fp32_bytes = 4 * cluster.values_per_link
    bw, n = cluster.link_bytes_per_s, cluster.peers
    if strategy.all_gather:
        transfer = all_gather_seconds(fp32_bytes / strategy.message_ratio, n, bw)
    else:
        transfer = ring_allreduce_seconds(fp32_bytes, n, bw)
    return transfer * overlap.allreduce_vs_ideal + _codec_seconds(strategy, cluster, overlap, background=True)


def _codec_seconds(strategy: Strategy, cluster: Cluster, overlap: Overlap, *, background: bool) -> float:
    """Codec seconds of one stage worker per round (the M stage workers code their shards in parallel)."""
    shard = cluster.params / cluster.stages
    per_param = strategy.background_s_per_param_member * cluster.peers if background else strategy.encode_s_per_param
    return per_param * shard / overlap.codec_speedup


def round_wall_seconds(compute_s: float, exchange_s: float, overlap: Overlap, *, inner_steps: int,
                       encode_s: float = 0.0) -> float:  # fmt: skip
    """Wall seconds of one round of H steps of C seconds each, with the exchange in the background.

    delayed: max(H C, E). streaming: each of P fragment exchanges may take tau steps before training
    waits for it. Then the encode (blocking) and the measured background share of the round are added.
    """
    round_compute = inner_steps * compute_s
    fragments = overlap.fragments if overlap.mode == "streaming" else 1
    window = overlap.overlap_steps * compute_s if overlap.mode == "streaming" else round_compute
    stalled = round_compute + fragments * max(0.0, exchange_s / fragments - window)
    overhead = (1 / overlap.utilization - 1) * round_compute
    return max(stalled, exchange_s) + encode_s + overhead


def ours_round(strategy: Strategy, cluster: Cluster, compute: Compute, overlap: Overlap) -> dict[str, float]:
    """One round of ours: its compute, exchange, encode and wall seconds."""
    c = step_compute_seconds(cluster, compute)
    e = exchange_seconds(strategy, cluster, overlap)
    encode = _codec_seconds(strategy, cluster, overlap, background=False)
    wall = round_wall_seconds(c, e, overlap, inner_steps=compute.inner_steps, encode_s=encode)
    return {"compute_s": compute.inner_steps * c, "exchange_s": e, "encode_s": encode, "wall_s": wall}


def ratio_vs_fp32_ring(strategy: Strategy, peers: int) -> float:
    """Bytes a member sends for the fp32 ring / for this strategy: r x 2/D when all-gathered."""
    return strategy.message_ratio * 2 / peers if strategy.all_gather else 1.0


# ----- measured inputs ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    value: float
    source: str
    measured: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    utilization: Figure
    allreduce_vs_ideal: Figure
    strategies: tuple[Strategy, ...]
    notes: tuple[str, ...] = ()
    quality: dict[str, Any] = field(default_factory=dict)


def _read(results: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((results / name).read_text())
    except (OSError, ValueError):
        return None


def _utilization(results: Path, notes: list[str]) -> Figure:
    """The share of throughput kept while an exchange runs in the background. overlap.json measures exactly that
    (delayed vs no averaging, interleaved repeats); netns.json's low-rank run also pays low-rank's codec on the
    lab's shared CPU, which the model adds on its own (compression.json), so it is the fallback."""
    overlap = _read(results, "overlap.json") or {}
    summary = overlap.get("ratio_summary", {})
    keys = [k for k in summary if k.startswith("delayed")]
    key = "delayed (helper_nice 0)" if "delayed (helper_nice 0)" in keys else (keys[0] if keys else None)
    mean = summary[key].get("mean") if key and isinstance(summary[key], dict) else None
    if isinstance(mean, (int, float)) and mean > 0:
        return Figure(value=min(mean, 1.0),
                      source=f"overlap.json: ratio_summary['{key}'].mean (tokens/s vs no averaging, "
                             f"{overlap.get('link', '?')})", measured=True)  # fmt: skip
    netns = _read(results, "netns.json")
    found = _netns_utilization(netns) if netns else None
    notes.append("overlap.json missing or without a delayed ratio: utilization from "
                 + ("netns.json (its codec seconds are counted twice)" if found else "nowhere"))  # fmt: skip
    if found:
        return Figure(value=min(found[0], 1.0), source=f"netns.json: {found[1]}", measured=True)
    notes.append("utilization 1.0 assumed (DEFAULT)")
    return Figure(value=1.0, source="default: nothing measured", measured=False)


def _allreduce_vs_ideal(results: Path, notes: list[str]) -> Figure:
    netns = _read(results, "netns.json")
    row = next((r for r in (netns or {}).get("allreduce", []) if r.get("strategy") == "none"), None)
    if row:
        return Figure(value=max(row["vs_ideal"], 1.0), measured=True,
                      source=f"netns.json: allreduce[strategy none].vs_ideal (the fp32 butterfly of "
                             f"{row['values']:,} values at {row['rate_mbit']:g} Mbit/s: {row['seconds']:.2f} s)")  # fmt: skip
    notes.append("netns.json " + ("has no fp32 all-reduce row" if netns else "missing") + ": all-reduce efficiency "
                 "derived from modes.json (sync fp32 on the slowest link; an upper bound: its wait includes "
                 "matchmaking and waiting for the slowest peer's training)")  # fmt: skip
    modes = (_read(results, "modes.json") or {}).get("results", {})
    try:
        rate, key = min((float(r), r) for r in modes if _is_float(r) and "sync" in modes[r].get("modes", {}))
        sync = modes[key]["modes"]["sync"]
        waited = sync["wall_s"] * sync["wait_share"] / sync["syncs"]
        ideal = sync["bytes_sent_per_sync"] / (rate * 1e6 / 8)
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        notes.append("modes.json missing or without a sync run: all-reduce efficiency 1.0 (ideal) assumed (DEFAULT)")
        return Figure(value=1.0, source="default: nothing measured", measured=False)
    return Figure(
        value=max(waited / ideal, 1.0), source=f"modes.json: results['{key}'].modes.sync: wall_s x wait_share / "
        f"syncs ({waited:.2f} s) over bytes_sent_per_sync at {rate:g} Mbit/s ({ideal:.2f} s)", measured=True,
    )  # fmt: skip


def _netns_utilization(netns: dict[str, Any]) -> tuple[float, str] | None:
    """The share of throughput kept while exchanges run in the background: ours' `lowrank` (delayed, the model's
    default mode) on the lab's fastest setting, where its exchange hides behind the round."""
    runs = [(name, res["lowrank"]) for name, res in netns.get("results", {}).items()
            if res.get("lowrank", {}).get("utilization")]  # fmt: skip
    if not runs:
        return None
    name, run = max(runs, key=lambda item: item[1].get("rate_mbit") or 0.0)
    return run["utilization"], f"results['{name}'].lowrank.utilization (delayed low-rank, tokens/s vs nocomm)"


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _strategies(results: Path, notes: list[str]) -> tuple[Strategy, ...]:
    data = _read(results, "compression.json")
    if not data or not data.get("strategies"):
        notes.append("compression.json missing: only fp32 (and any --assumed-ratio) projected (DEFAULT)")
        return (FP32,)
    group = data.get("group_size", 3)
    out = [FP32]
    for name, s in data["strategies"].items():
        try:
            params = s["params"]
            out.append(Strategy(
                name=name, message_ratio=s["ratio_vs_fp32_message"], all_gather=True,
                encode_s_per_param=s["encode_s"] / params,
                background_s_per_param_member=(s.get("phase2_s", 0.0) + s["decode_s"]) / params / group,
                source=f"compression.json: strategies['{name}'] (ratio_vs_fp32_message; encode_s; (phase2_s + "
                       f"decode_s) / group_size {group}; preset {data.get('preset')}, {params:,} params)",
            ))  # fmt: skip
        except (KeyError, TypeError, ZeroDivisionError):
            notes.append(f"compression.json: strategy {name!r} lacks a field the model reads: left out")
    return tuple(out)


def _quality(results: Path) -> dict[str, Any]:
    """This project's loss gaps at equal tokens (what the throughput leaves out)."""
    out: dict[str, Any] = {}
    for name in ("modes_quality.json", "convergence.json"):
        summary = (_read(results, name) or {}).get("summary", {})
        if summary:
            out[name] = {k: {"vs_sync_fp32": v.get("vs_sync_fp32"), "ratio_vs_fp32_ring": v.get("ratio_vs_fp32_ring")}
                         for k, v in summary.items()}  # fmt: skip
    return out


def load_measured(results: Path = RESULTS) -> Measured:
    """The measured inputs from results/*.json, each with its source; a missing file gives a flagged default."""
    notes: list[str] = []
    return Measured(
        utilization=_utilization(results, notes), allreduce_vs_ideal=_allreduce_vs_ideal(results, notes),
        strategies=_strategies(results, notes), notes=tuple(notes), quality=_quality(results),
    )  # fmt: skip


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
