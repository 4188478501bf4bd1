"""A signed stage worker's DHT node for tests that build averagers by hand (tests/swarm/).

    dht, signer, gate = signed_node(tmp_dir, run_id="ar", initial_peers=[...])
    DilocoxAverager(tensors, dht, ..., signer=signer, gate=gate)

The same keys, certificate and validator as a real worker (swarm/stage.py), in an open run.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hivemind

from dilocox_p2p.config import load_config
from dilocox_p2p.envelope import Gate, Policy, Signer
from dilocox_p2p.identity import certify_worker, peer_id_of, run_identity, worker_identity
from dilocox_p2p.swarm.dht import EnvelopeValidator, run_keys, start_dht

__all__ = ["signed_node"]


def signed_node(
    run_id: str,
    *,
    root: Path | None = None,
    home: Path | None = None,
    initial_peers: Sequence[Any] = (),
    stage: int = 0,
    peer_home: Path | None = None,
    **swarm: Any,
) -> tuple[hivemind.DHT, Signer, Gate]:
    """`home`: the node's directory (its keys), to start a node again under the keys of one that stopped;
    None: a new directory under `root`. `peer_home`: where its peer key is (default: `home`), so that several
    nodes' workers can be certified by one peer key."""
    root = home or Path(tempfile.mkdtemp(prefix="signed-node-", dir=root))
    key_path = root / f"stage{stage}.ed25519"
    worker_key = worker_identity(key_path)
    cert = certify_worker(run_identity(peer_home or root), peer_id_of(worker_key), run_id=run_id, stage=stage,
                          peer_name=root.name)  # fmt: skip
    signer, gate = Signer(worker_key, cert), Gate(Policy(run_id=run_id))
    overrides = {"swarm.host_maddrs": ["/ip4/127.0.0.1/tcp/0"], **{f"swarm.{k}": v for k, v in swarm.items()}}
    cfg = load_config(overrides=overrides)
    validator = EnvelopeValidator(Gate(Policy(run_id=run_id)), run_keys(run_id, "0" * 64))
    extra = [str(m) for m in initial_peers]
    dht = start_dht(cfg.swarm, stage=stage, identity_path=key_path, validator=validator, extra_peers=extra)
    return dht, signer, gate
