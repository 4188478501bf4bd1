"""Per-round records (RUN_DIR/metrics.jsonl) and the progress display of the lead stage.

One JSON object per completed round, appended and fsynced, so a crash never leaves a
torn line behind a complete one. On resume, records of rounds that will be trained again
are dropped first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsWriter", "Progress", "read_metrics"]

REQUIRED_FIELDS = (
    "round",
    "train_loss",
    "val_loss",
    "tokens",
    "tokens_per_s",
    "seconds_compute",
    "seconds_comm_wait",
    "bytes_sent",
    "bytes_received",
    "params",
    "stage_hashes",
)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete records of a metrics.jsonl (a torn last line is ignored)."""
    records = []
    if not Path(path).exists():
        return records
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


class MetricsWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_from(self, round: int) -> None:
        """Drop records of `round` and later (they will be trained again)."""
        kept = [r for r in read_metrics(self.path) if r["round"] < round]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def append(self, record: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in record]
        assert not missing, f"metrics record lacks {missing}"
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


class Progress:
    """A bar per round on a terminal (tqdm), one plain line per round otherwise."""

    def __init__(self, *, rounds: int, steps: int, first_round: int, style: str, label: str = "", out: TextIO | None = None):
        self.out = out or sys.stderr
        if style == "auto":
            style = "bar" if self.out.isatty() else "lines"
        self.style, self.rounds, self.steps, self.label = style, rounds, steps, label
        self.bar = None
        if style == "bar":
            from tqdm import tqdm

            self.bar = tqdm(
                total=(rounds - first_round) * steps,
                file=self.out,
                unit="step",
                dynamic_ncols=True,
                desc=self._desc(first_round),
            )

    def _desc(self, round: int) -> str:
        return f"{self.label}round {min(round + 1, self.rounds)}/{self.rounds}"

    def step(self, round: int) -> None:
        if self.bar is not None:
            self.bar.set_description(self._desc(round), refresh=False)
            self.bar.update(1)

    def round_done(self, record: dict[str, Any]) -> None:
        val = record["val_loss"]
        loss = f"{record['train_loss']:.4f}" if record["train_loss"] is not None else "-"  # none after a jump
        if self.bar is not None:
            self.bar.set_postfix(
                loss=loss, val=f"{val:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", group=record.get("group_size") or "-"
            )
        elif self.style == "lines":
            stamp = time.strftime("%H:%M:%S")
            print(
                f"{stamp} {self.label}round {record['round'] + 1}/{self.rounds} train_loss {loss} val_loss {val:.4f} "
                f"tokens/s {record['tokens_per_s']:.0f} wait {record['seconds_comm_wait']:.2f}s "
                f"group {record.get('group_size') or '-'} hash {record['stage_hashes'][0][:12]}",
                file=self.out,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
