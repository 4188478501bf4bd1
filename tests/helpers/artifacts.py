"""What a failed test leaves behind for the next reader: its peers' logs and records, kept after pytest's
temporary directories are gone (CI keeps no run directories).

A test that fails copies its `tmp_path` (tests/conftest.py) to ARTIFACTS/<test id>/: logs, metrics,
start-up marks, configs and run info; not checkpoints, keys or the corpus cache. ARTIFACTS is
$DILOCOX_TEST_ARTIFACTS, or test-artifacts/ in the repository. `.ci/run` then prints a digest of
each (`python -m tests.helpers.artifacts DIR`): every warning and error of every stage log, and the
last lines of each, so that the CI output alone explains the failure.
"""

from __future__ import annotations

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


def digest(folder: Path) -> str:
    """Every warning and error of each stage log under `folder`, then its last lines; bounded."""
    lines: list[str] = []
    for log in sorted(folder.rglob("stage*.log")):
        text = log.read_text(errors="replace").splitlines()
        lines.append(f"--- {log.relative_to(folder)} ({len(text)} lines)")
        noted = [line for line in text if " WARN" in line or " ERROR" in line or '"level": "WARN' in line]
        lines += [*noted, f"--- last {DIGEST_TAIL} lines of {log.name}", *text[-DIGEST_TAIL:]]
    if len(lines) > DIGEST_MAX_LINES:
        lines = lines[:DIGEST_MAX_LINES] + [f"[... {len(lines) - DIGEST_MAX_LINES} more lines in {folder} ...]"]
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
