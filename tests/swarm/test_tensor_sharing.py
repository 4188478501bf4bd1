"""A stage's helper processes cost what they must: its DHT node and averager share tensors by file descriptor (no
torch_shm_manager beside each stage), and its p2p daemon collects garbage lazily (swarm/daemon_gc.py).

hivemind sets torch's sharing strategy to "file_system" at import, which starts a torch_shm_manager process in
every process that shares a tensor (0.5 CPU-s each; hivemind_patches.share_tensors_by_descriptor). Run in a fresh
interpreter: the strategy and the manager are per process, and the test worker's own may have either already.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.swarm

_SCRIPT = textwrap.dedent(
    """
    import json, os, resource
    import torch, torch.multiprocessing
    from dilocox_p2p.swarm.averager import DilocoxAverager
    from tests.helpers.signed import signed_node

    os.environ.pop("GOGC", None)  # join's defaults, whatever this machine's environment says
    os.environ.pop("GOMEMLIMIT", None)
    before = torch.multiprocessing.get_sharing_strategy()  # hivemind's, set at its import
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    dht, signer, gate = signed_node("sharing")
    tensor = torch.arange(8, dtype=torch.float32)
    averager = DilocoxAverager(
        [tensor], dht, run_id="sharing", config_hash="0" * 64, stage=0, prefix="sharing_s0", start=True,
        min_group_size=2, min_matchmaking_time=5.0, request_timeout=2.5, allreduce_timeout=10.0,
        next_chunk_timeout=5.0, allow_state_sharing=False, signer=signer, gate=gate,
    )
    with averager.get_tensors() as held:  # the stage's tensor as shared with the averager process
        seen = held[0].tolist()

    def descendants(root):
        found, todo = [], [root]
        daemons = []
        while todo:
            pid = todo.pop()
            try:
                children = open(f"/proc/{pid}/task/{pid}/children").read().split()
            except OSError:
                continue
            for child in map(int, children):
                try:
                    found.append(open(f"/proc/{child}/comm").read().strip())
                    if found[-1] == "p2pd":
                        environ = open(f"/proc/{child}/environ", "rb").read().split(b"\\0")
                        daemons.append(sorted(e.decode() for e in environ if e.startswith((b"GOGC=", b"GOMEMLIMIT="))))
                except OSError:
                    continue
                todo.append(child)
        return found, daemons

    names, daemons = descendants(os.getpid())
    print(json.dumps(dict(before=before, after=torch.multiprocessing.get_sharing_strategy(), seen=seen,
                          processes=names, daemons=daemons, soft=resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard=hard)))
    averager.shutdown()
    dht.shutdown()
    """
)


def test_a_stage_averager_shares_its_tensors_by_descriptor_and_its_daemon_collects_garbage_lazily():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["before"] == "file_system", "hivemind no longer sets file_system: share_tensors_by_descriptor may go"
    assert report["after"] == "file_descriptor"
    assert report["seen"] == [float(i) for i in range(8)]  # sharing kept the stage's values
    assert any(name == "p2pd" for name in report["processes"]), report  # descendants were found at all
    assert not any(name.startswith("torch_shm") for name in report["processes"]), report
    assert report["soft"] >= min(report["hard"], 65536)
    assert report["daemons"] == [["GOGC=400", "GOMEMLIMIT=512MiB"]], report  # the DHT process set them for its daemon
