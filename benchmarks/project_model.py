"""The cost model of benchmarks/project.py: its assumptions and the arithmetic of one step and one round.

The frozen settings (Cluster, Compute, Baseline, Overlap: each field a named assumption with its source) and a
Strategy (a compression scheme's measured ratio and codec seconds, FP32 the uncompressed reference), and the
formulas of the model that benchmarks/project.py's docstring writes out: an ideal ring all-reduce and an
all-gather, one inner step's compute, DDP's step with its all-reduce, our exchange and one round's wall seconds.
Pure arithmetic, nothing read or written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FP32", "Baseline", "Cluster", "Compute", "Overlap", "Strategy",
    "all_gather_seconds", "ddp_allreduce_seconds", "ddp_step_seconds", "exchange_seconds", "ours_round",
    "ratio_vs_fp32_ring", "ring_allreduce_seconds", "round_wall_seconds", "step_compute_seconds",
]  # fmt: skip


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
