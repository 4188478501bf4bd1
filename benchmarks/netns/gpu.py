"""The GPU settings the lab stands for, and the lab link rate that gives each the same weight of communication.

A tiny model on 2 CPU cores computes slowly next to what it sends; a 1B model on an H100 computes fast
next to what it sends. What decides how much communication costs, and how much of it overlap can hide,
is the ratio of the fp32 exchange time to the compute time of one round:

    ratio         = ring_seconds / round_seconds
    ring_seconds  = 2 (N-1)/N x 4 bytes x params x 8 / link bits/s   (bandwidth-optimal ring all-reduce, fp32)
    round_seconds = H x tokens_per_step x 6 x params / (peak FLOP/s x MFU)

Each `GpuSetting` states its assumptions (every number is a flag of benchmarks.netns); `lab_rate_mbit`
picks the lab's link rate so that the lab's ratio (the tiny model's fp32 ring time against its round
time measured with no communication) equals the setting's. Not matched: DDP all-reduces every step, so
its per-step ratio is the round ratio x H, and the lab's H is smaller than the setting's (see
`GpuSetting.ddp_slowdown`), nor the CPU the lab's communication takes from training (a GPU's is spare).
"""

from __future__ import annotations

from dataclasses import dataclass

from dilocox_p2p.config import PRESETS
from dilocox_p2p.model import unit_param_counts

__all__ = ["GpuSetting", "lab_rate_mbit", "ring_bytes", "ring_seconds"]


def ring_bytes(params: int, peers: int, *, bytes_per_value: float = 4.0) -> float:
    """Bytes each member sends (and receives) in a bandwidth-optimal ring all-reduce: 2 (N-1)/N x payload."""
    return 2 * (peers - 1) / peers * bytes_per_value * params


def ring_seconds(payload_bytes: float, peers: int, rate_mbit: float) -> float:
    """Seconds of a bandwidth-optimal ring all-reduce of `payload_bytes` per member over `rate_mbit` links."""
    return 2 * (peers - 1) / peers * payload_bytes * 8 / (rate_mbit * 1e6)


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSetting:
    """One peer = one GPU training `preset`; peers joined by links of `link_mbit`."""

    link_mbit: float
    """Each peer's link, Mbit/s."""
    preset: str = "1b"
    """Model preset (dilocox_p2p.config.PRESETS); its parameter count sets both compute and bytes."""
    gpu: str = "H100 SXM"
    peak_tflops: float = 989.0
    """Dense bf16 peak of the GPU, TFLOP/s (H100 SXM: 989)."""
    mfu: float = 0.4
    """Model FLOPs utilization assumed (share of the peak that training achieves)."""
    tokens_per_step: int = 2**19
    """Tokens per inner step per peer (256 sequences of 2048)."""
    inner_steps: int = 100
    """H: inner steps per round (join's default, and Streaming DiLoCo's)."""
    peers: int = 4

    @property
    def name(self) -> str:
        link = f"{self.link_mbit / 1000:g} Gbit/s" if self.link_mbit >= 1000 else f"{self.link_mbit:g} Mbit/s"
        return f"{self.preset} on one {self.gpu} per peer at {link}"

    @property
    def params(self) -> int:
        return sum(unit_param_counts(PRESETS[self.preset]))

    @property
    def step_seconds(self) -> float:
        """One inner step: 6 x params FLOPs per token (forward + backward)."""
        return 6 * self.params * self.tokens_per_step / (self.peak_tflops * 1e12 * self.mfu)

    @property
    def round_seconds(self) -> float:
        return self.inner_steps * self.step_seconds

    @property
    def fp32_ring_seconds(self) -> float:
        return ring_seconds(4 * self.params, self.peers, self.link_mbit)

    @property
    def ratio(self) -> float:
        """fp32 ring all-reduce time of the pseudo-gradient / round compute time."""
        return self.fp32_ring_seconds / self.round_seconds

    @property
    def ddp_slowdown(self) -> float:
        """no-communication / DDP throughput on this setting, if the all-reduce of each step overlaps nothing."""
        return 1 + self.fp32_ring_seconds / self.step_seconds

    def describe(self) -> dict:
        return {
            "name": self.name, "link_mbit": self.link_mbit, "preset": self.preset, "params": self.params,
            "gpu": self.gpu, "peak_tflops": self.peak_tflops, "mfu": self.mfu, "tokens_per_step": self.tokens_per_step,
            "inner_steps": self.inner_steps, "peers": self.peers, "step_seconds": self.step_seconds,
            "round_seconds": self.round_seconds, "fp32_ring_seconds": self.fp32_ring_seconds, "ratio": self.ratio,
            "ddp_slowdown": self.ddp_slowdown,
        }  # fmt: skip


def lab_rate_mbit(setting: GpuSetting, *, lab_params: int, lab_round_seconds: float) -> float:
    """The lab link rate (Mbit/s) at which the lab model's fp32 ring time / round time equals the setting's."""
    return ring_bytes(lab_params, setting.peers) * 8 / (setting.ratio * lab_round_seconds) / 1e6
