"""A DHT node a test starts and stops many times over, on command, in a process of its own (a host of a netns lab).

    python -m tests.helpers.dht_agent bootstrap STATE_DIR LISTEN_MADDR [INITIAL_PEER...]
    python -m tests.helpers.dht_agent peer WORK_DIR LISTEN_MADDR [INITIAL_PEER...]

Reads one command per line on stdin and answers one JSON line on stdout:
    start   bootstrap: a real BootstrapNode (dilocox_p2p/bootstrap.py) with its status loop, fellows asked every
            STATUS_PERIOD_S; peer: a stage worker's DHT node as `join` starts it (swarm.dht.start_dht, then a
            RouteKeeper) under a new key each time -> {"started": PEER_ID} or {"error": ...}
    look    peer: store its own entry under one shared key (as a heartbeat does), then read the key (latest)
            -> {"seen": [peer ids of the entries found]}
    stop    stop the node -> {"stopped": true}
The process imports hivemind once, so a test can repeat a whole swarm's start many times in seconds.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils import get_dht_time

from dilocox_p2p.bootstrap import BootstrapNode, BootstrapOptions
from dilocox_p2p.config import load_config
from dilocox_p2p.swarm.dht import start_dht
from dilocox_p2p.swarm.faults import FaultCounter
from dilocox_p2p.swarm.reconnect import RouteKeeper

SHARED_KEY = "one-dht-test"
STATUS_PERIOD_S = 1.0


class AnyRecord(RecordValidatorBase):
    """Takes every record: this DHT holds only the test's entries (a run's validator refuses plain values)."""

    def validate(self, record: Any) -> bool:
        return True


class Agent:
    def __init__(self, role: str, work_dir: Path, listen: str, initial: list[str]):
        self.role, self.work_dir, self.listen, self.initial = role, work_dir, listen, initial
        self.node: Any = None
        self.routes: RouteKeeper | None = None
        self.stop_event = threading.Event()
        self.serving: threading.Thread | None = None
        self.starts = 0

    def start(self) -> dict:
        self.starts += 1
        if self.role == "bootstrap":
            opts = BootstrapOptions(state_dir=self.work_dir, host_maddrs=(self.listen,), initial_peers=tuple(self.initial),
                                    status_period=STATUS_PERIOD_S)  # fmt: skip
            self.node = BootstrapNode.start(opts)
            self.stop_event.clear()
            self.serving = threading.Thread(target=self.node.serve, args=(self.stop_event,), daemon=True)
            self.serving.start()
            return {"started": self.node.peer_id}
        cfg = load_config(overrides={"swarm.host_maddrs": [self.listen], "swarm.initial_peers": self.initial})
        key = Path(tempfile.mkdtemp(dir=self.work_dir)) / "stage0.ed25519"
        self.node = start_dht(cfg.swarm, stage=0, identity_path=key, validator=AnyRecord())
        self.routes = RouteKeeper(self.node, initial_peers=self.initial, members=dict, faults=FaultCounter())
        self.routes.start()
        return {"started": self.node.peer_id.to_base58()}

    def look(self) -> dict:
        me = self.node.peer_id.to_base58()
        self.node.store(SHARED_KEY, b"here", expiration_time=get_dht_time() + 60, subkey=me)
        found = self.node.get(SHARED_KEY, latest=True)
        return {"seen": sorted(found.value) if found is not None and isinstance(found.value, dict) else []}

    def stop(self) -> dict:
        if self.role == "bootstrap":
            self.stop_event.set()
            self.serving.join(timeout=30)
            self.node.stop()
        else:
            self.routes.close()
            self.node.shutdown()
        self.node = None
        return {"stopped": True}


def main(argv: list[str]) -> int:
    role, work_dir, listen, *initial = argv
    agent = Agent(role, Path(work_dir), listen, initial)
    for line in sys.stdin:
        command = line.strip()
        try:
            answer = {"start": agent.start, "look": agent.look, "stop": agent.stop}[command]()
        except Exception as e:  # noqa: BLE001 - the test reads the reason
            answer = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(json.dumps(answer), flush=True)
    if agent.node is not None:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
