"""Model presets: the shapes `model.preset` names (config.ModelConfig), from CPU tests to a billion parameters."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "ModelShape"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Architecture of a byte-level GPT preset."""

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(n_layer=4, d_model=64, n_head=4, seq_len=128),  # ~0.24M params, CPU tests
    "mini": ModelShape(n_layer=6, d_model=128, n_head=4, seq_len=128),  # ~1.3M, the quality lab's second size
    "small": ModelShape(n_layer=8, d_model=512, n_head=8, seq_len=512),  # ~25M
    "125m": ModelShape(n_layer=18, d_model=768, n_head=12, seq_len=1024),  # ~128M
    "350m": ModelShape(n_layer=28, d_model=1024, n_head=16, seq_len=1024),  # ~354M
    "1b": ModelShape(n_layer=20, d_model=2048, n_head=16, seq_len=2048),  # ~1.0B
}
