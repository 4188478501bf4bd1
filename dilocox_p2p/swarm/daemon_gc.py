"""The Go garbage collector's settings of the p2p daemon hivemind starts beside each DHT node (`p2pd`).

hivemind starts `p2pd` with this process's environment. At Go's default (GOGC=100) the daemon collects its garbage
each time its heap doubles, and every byte it relays (our parts, messages and DHT records) is garbage soon after.
At GOGC=400, side by side on 2 EPYC cores (benchmarks/daemon_gc.py, results/daemon_gc*.json): 100 calls of 500 kB
between two daemons cost each 0.72x the CPU (0.67 CPU-s against 0.93), 1,000 calls of 2 kB 0.88x; a three-peer
swarm test's daemons spent 7.6-8.2 CPU-s against 8.5-10.3. The cost is memory: a peak of 174 MB instead of 97 MB
after the large calls, the same after the small ones. GOMEMLIMIT (Go 1.19+; hivemind 1.1.11's daemon is built with
Go 1.20) caps what the laxer collector may let the heap grow to: near the cap it collects as often as it must. An
operator's own GOGC or GOMEMLIMIT wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["DAEMON_GOGC", "DAEMON_GOMEMLIMIT", "tune_daemon_gc"]

DAEMON_GOGC = "400"  # collect when the heap has grown by 4x what survived the last collection
DAEMON_GOMEMLIMIT = "512MiB"  # ... but never let it pass this for want of collecting


def tune_daemon_gc(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set GOGC and GOMEMLIMIT in `environ` (the process that starts the daemon), unless already set."""
    environ.setdefault("GOGC", DAEMON_GOGC)
    environ.setdefault("GOMEMLIMIT", DAEMON_GOMEMLIMIT)
