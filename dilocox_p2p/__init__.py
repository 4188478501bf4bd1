"""dilocox-p2p: decentralized DiLoCoX pre-training across GPU clusters on ordinary links.

Each cluster is one peer of a hivemind DHT; inside a peer, training is pipeline-parallel;
between peers only pseudo-gradients travel, averaged in the background one round behind.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import Config, config_hash, load_config  # noqa: E402
from .errors import (  # noqa: E402
    AdmissionError,
    CheckpointError,
    ConfigError,
    DataError,
    DilocoxError,
    SwarmError,
    WireRejected,
)



def __getattr__(name: str) -> object:
    """`Average` and `AverageKind` import torch: loaded on first use, so that light commands
    (`dilocox-peer status`, `dilocox-bootstrap`) start fast."""
    if name in ("Average", "AverageKind"):
        from . import average

        return getattr(average, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdmissionError",
    "Average",
    "AverageKind",
    "CheckpointError",
    "Config",
    "ConfigError",
    "DataError",
    "DilocoxError",
    "SwarmError",
    "WireRejected",
    "__version__",
    "config_hash",
    "load_config",
]
