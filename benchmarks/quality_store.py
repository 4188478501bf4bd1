"""Runs of the quality lab (benchmarks/convergence.py), recorded as they go and resumable.

A run is one configuration at one outer lr and momentum. In the store (a directory, one per result name) it owns:

- `<run>.jsonl`: a header line (the configuration, lr, momentum), a line per outer round (its val loss, the bytes a
  peer sent so far, seconds), and, once it finished, a last line with its result;
- `<run>.pt`: its whole state every --checkpoint-every rounds (every peer's outer loop, optimizer, codecs and data
  sampler, the group's byte counts, torch's RNG), written to a temporary file and renamed, so a kill never leaves
  half of one.

A run whose record holds its result is not run again. One that stopped (killed, crashed, the machine gone) goes on
from its checkpoint: its rounds after the checkpoint are run again and come out the same (every part is seeded;
tests/unit/test_convergence_benchmark.py holds a resumed run to the bits of one run straight through). `store.json`
names the shape every run of the store shares (preset, peers, rounds, H, batch, warmup, validation batches): a store
of another shape is refused, never mixed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunKey", "RunStore", "StoreMismatch"]


class StoreMismatch(SystemExit):
    """The store holds runs of another shape."""


@dataclass(frozen=True, slots=True)
class RunKey:
    label: str
    lr: float
    momentum: float

    @property
    def stem(self) -> str:
        """A file name for the run: the configuration's words, lr and momentum."""
        words = re.sub(r"[^A-Za-z0-9.]+", "-", self.label).strip("-")
        return f"{words}__lr{self.lr:g}__m{self.momentum:g}"


class RunStore:
    """The records and checkpoints of one result's runs, under `root`."""

    def __init__(self, root: Path, shape: dict[str, Any]):
        self.root, self.shape = Path(root), dict(shape)
        self.root.mkdir(parents=True, exist_ok=True)
        meta = self.root / "store.json"
        if meta.exists():
            held = json.loads(meta.read_text())
            if held != self.shape:
                diff = {k: (held.get(k), self.shape.get(k)) for k in {*held, *self.shape} if held.get(k) != self.shape.get(k)}
                raise StoreMismatch(
                    f"{self.root} holds runs of another shape (stored, asked: {diff}); pass another --name, or delete "
                    "that directory to start its runs over"
                )
        else:
            _write_atomic(meta, json.dumps(self.shape, indent=2, sort_keys=True).encode())

    def _records(self, key: RunKey) -> Path:
        return self.root / f"{key.stem}.jsonl"

    def _checkpoint(self, key: RunKey) -> Path:
        return self.root / f"{key.stem}.pt"

    def lines(self, key: RunKey) -> list[dict[str, Any]]:
        """The run's record as written; a last line cut by a kill is left out."""
        path = self._records(key)
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # written in part when the run was killed: nothing after it was written
        return out

    def finished(self, key: RunKey) -> dict[str, Any] | None:
        """The run's result if it finished, else None."""
        lines = self.lines(key)
        return lines[-1]["result"] if lines and "result" in lines[-1] else None

    def resume(self, key: RunKey) -> dict[str, Any] | None:
        """The run's last checkpoint (None: start it from round 0); its record is cut back to the checkpoint's round,
        so that the rounds run again are recorded once."""
        import torch

        path = self._checkpoint(key)
        if not path.exists():
            self._rewrite(key, [])
            return None
        state = torch.load(path, weights_only=False)
        self._rewrite(key, [line for line in self.lines(key) if line.get("round", -1) < state["rounds_done"]])
        return state

    def begin(self, key: RunKey, header: dict[str, Any]) -> None:
        """Write the run's header unless its record already starts with one (a resumed run)."""
        lines = self.lines(key)
        if not lines or "header" not in lines[0]:
            self._rewrite(key, [{"header": {"label": key.label, "lr": key.lr, "momentum": key.momentum, **header}}])

    def record_round(self, key: RunKey, row: dict[str, Any]) -> None:
        with self._records(key).open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def checkpoint(self, key: RunKey, state: dict[str, Any]) -> None:
        """Keep `state` (its "rounds_done": outer rounds whose records are written) as the run's checkpoint."""
        import io

        import torch

        buffer = io.BytesIO()
        torch.save(state, buffer)
        _write_atomic(self._checkpoint(key), buffer.getvalue())

    def finish(self, key: RunKey, result: dict[str, Any]) -> None:
        """Record the run's result; its checkpoint is no longer needed."""
        self.record_round(key, {"result": result})
        self._checkpoint(key).unlink(missing_ok=True)

    def _rewrite(self, key: RunKey, lines: list[dict[str, Any]]) -> None:
        _write_atomic(self._records(key), "".join(json.dumps(line) + "\n" for line in lines).encode())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
