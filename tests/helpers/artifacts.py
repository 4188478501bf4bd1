"""What a failed test leaves behind for the next reader: its peers' logs and records, kept after pytest's
temporary directories are gone (CI keeps no run directories).

A test that fails copies its `tmp_path` (tests/conftest.py) to ARTIFACTS/<test id>/: logs, metrics,
start-up marks, configs and run info; not checkpoints, keys or the corpus cache. ARTIFACTS is
$DILOCOX_TEST_ARTIFACTS, or test-artifacts/ in the repository. `.ci/run` then prints a digest of
each (`python -m tests.helpers.artifacts DIR`): every warning and error of every stage log, and the
last lines of each, so that the CI output alone explains the failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEEP_SUFFIXES = {".log", ".jsonl", ".json", ".out", ".txt", ".toml"}
SKIP_DIRS = {"checkpoints", "identity", "cache0", "corpus"}
MAX_FILE_BYTES = 2_000_000  # a longer file keeps its tail
DIGEST_TAIL = 15
DIGEST_MAX_LINES = 400
# INFO lines that explain a split or a lost part (matchmaking.py, allreduce.py, exchange.py): kept with the warnings
NOTED_INFO = (
    "to take this worker into its group:",  # "no group", or "accepted, then no group" (a possible split)
    "request to join this worker's group:",  # why a leader refused it (matchmaking.screen_join_requests)
    "is not in this group",
    "counted this worker into",
    "averaged parts came before",  # allreduce.py: why a reducer's or a sender's stream failed
    "the parts of sender",
    "parts: banned from this all-reduce",
)


def artifacts_dir() -> Path:
    return Path(os.environ.get("DILOCOX_TEST_ARTIFACTS") or ROOT / "test-artifacts")


def clear() -> None:
    """Remove the artifacts of an earlier session from test-artifacts/ (a directory named by
    $DILOCOX_TEST_ARTIFACTS is the caller's to clear)."""
    if not os.environ.get("DILOCOX_TEST_ARTIFACTS"):
        shutil.rmtree(ROOT / "test-artifacts", ignore_errors=True)


def keep(nodeid: str, source: Path) -> Path | None:
    """Copy what explains a failure from `source` to the artifacts directory; where it went (None: nothing)."""
    if not source.is_dir():
        return None
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[-150:]
    target = artifacts_dir() / name
    copied = 0
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if not path.is_file() or path.suffix not in KEEP_SUFFIXES or SKIP_DIRS & set(rel.parts):
            continue
        out = target / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        size = path.stat().st_size
        if size <= MAX_FILE_BYTES:
            shutil.copyfile(path, out)
        else:
            with open(path, "rb") as f:
                f.seek(size - MAX_FILE_BYTES)
                out.write_bytes(b"[... cut ...]\n" + f.read())
        copied += 1
    return target if copied else None


def rounds_summary(metrics: Path) -> list[str]:
    """A peer's round records in a few lines: runs of rounds alike (kinds, group sizes, no faults) as one."""
    rows: list[tuple[int, str]] = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
            faults = {k: v for k, v in r.get("faults", {}).items() if v}
            text = f"{r.get('kinds')} groups {r.get('group_sizes')}" + (f" faults {faults}" if faults else "")
            if r.get("replaced_stages"):
                text += f" replaced {r['replaced_stages']}"
            rows.append((r["round"], text))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    out: list[str] = []
    start = 0
    for i, (t, text) in enumerate(rows):
        if i + 1 == len(rows) or rows[i + 1][1] != text or rows[i + 1][0] != t + 1:
            first = rows[start][0]
            out.append(f"  round {first}: {text}" if first == t else f"  rounds {first}-{t}: {text}")
            start = i + 1
    return out


PEER_ID = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]{40,}")
DATE = re.compile(r"^\d{4}-\d\d-\d\d ")


def shortened(line: str) -> str:
    """A log line in fewer characters (CI shows a bounded part of its output): no date, peer ids as their
    last 6 characters (as the logs' own context shows them), no package prefix of module names."""
    line = DATE.sub("", line)
    line = PEER_ID.sub(lambda m: ".." + m.group(0)[-6:], line)
    return line.replace("dilocox_p2p.", "")


def digest(folder: Path) -> str:
    """Every warning and error of each stage log under `folder` (and its NOTED_INFO lines), then its last lines,
    then each peer's round records in short (last: CI shows the end of its output); bounded."""
    lines: list[str] = []
    for log in sorted(folder.rglob("stage*.log")):
        text = log.read_text(errors="replace").splitlines()
        lines.append(f"--- {log.relative_to(folder)} ({len(text)} lines)")
        noted = [line for line in text if " WARN" in line or " ERROR" in line or '"level": "WARN' in line
                 or any(marker in line for marker in NOTED_INFO)]
        tail = [f"--- last {DIGEST_TAIL} lines of {log.name}", *text[-DIGEST_TAIL:]]
        lines += [shortened(line) for line in (*noted, *tail)]
    if len(lines) > DIGEST_MAX_LINES:
        lines = lines[:DIGEST_MAX_LINES] + [f"[... {len(lines) - DIGEST_MAX_LINES} more lines in {folder} ...]"]
    for metrics in sorted(folder.rglob("metrics.jsonl")):
        lines += [f"--- round records of {metrics.parent.relative_to(folder)}", *rounds_summary(metrics)[-40:]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Print the digest of every test's artifacts under the given directory."""
    root = Path(argv[0]) if argv else artifacts_dir()
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        print(f"===== artifacts of {folder.name} (all files in {folder})")
        print(digest(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
