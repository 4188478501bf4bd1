"""Streaming DiLoCo's fragments: which of a stage's tensors sync at which sync event.

Streaming DiLoCo (arXiv 2501.18512) splits the model into P fragments of strided layer groups
and syncs them one after another, so that each all-reduce carries 1/P of the model and the
link's peak load falls about P times while each fragment still syncs every H inner steps.

Here a stage's layer groups are its units (`model.StageModule.layers`: the embedding, each
transformer block, the head). Fragment p holds the units at positions k with k mod P = p.
In streaming mode a worker's sync round s is H/P inner steps long and ends by syncing
fragment `fragment_of(s, P)`: fragment p syncs after every inner step t > 0 with
t mod H = p * H / P (the paper's offsets), i.e. at t = p*H/P + k*H (p > 0) and t = k*H (p = 0).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .errors import ConfigError

__all__ = ["as_fragments", "fragment_of", "fragment_tensors", "of_round"]

_UNIT = re.compile(r"^layers\.(\d+)\.")


def fragment_tensors(names: Sequence[str], count: int, *, stage: int = 0) -> list[list[int]]:
    """Indices of the tensors of each fragment, from the tensors' parameter names (`layers.<k>.<...>`).
    Every tensor lands in exactly one fragment; no fragment is empty."""
    units: list[int] = []
    for name in names:
        match = _UNIT.match(name)
        if match is None:
            raise ValueError(f"parameter {name!r} belongs to no layer group (expected layers.<k>.<name>)")
        units.append(int(match.group(1)))
    n_units = len(set(units))
    if count > n_units:
        raise ConfigError(
            f"outer.fragments = {count}: stage {stage} holds only {n_units} layer groups; "
            f"use at most {n_units} fragments, or fewer pipeline stages"
        )
    return [[i for i, unit in enumerate(units) if unit % count == p] for p in range(count)]


def fragment_of(sync_round: int, count: int) -> int:
    """The fragment that sync round `sync_round` (0-based, H/P inner steps each) ends by syncing."""
    return (sync_round + 1) % count


def as_fragments(fragments: Sequence[Sequence[int]] | None, n_tensors: int) -> list[list[int]]:
    """`fragments` as lists, or (None or empty) one fragment of all `n_tensors` tensors."""
    return [list(f) for f in fragments] if fragments else [list(range(n_tensors))]


def of_round(fragments: Sequence[Sequence[int]], sync_round: int) -> list[int]:
    """The tensor indices that sync round `sync_round` averages: its fragment's."""
    return list(fragments[fragment_of(sync_round, len(fragments))])
