"""A swarm of containers on shaped links: bootstrap + 3 peers (2 stages each) agree, survive a killed
peer, take in a late joiner, and a peer container restarted on its volume resumes from its checkpoint.

Everything is read the way an operator would: `dilocox-peer status --json` and `dilocox-peer health`
inside the containers, `docker logs`.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.helpers.containers import docker
from tests.helpers.peers import LIGHT_BATCH

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]

LINK = ["tbf", "rate", "50mbit", "burst", "64kb", "latency", "50ms"]


def _peer_args(initial: str, index: int) -> list[str]:
    return [
        "join", "--run-dir", "/data/run", "--resume", "auto", "--host-maddrs", "/ip4/0.0.0.0/tcp/31400",
        "--initial-peers", initial, "--run-id", "docker", "--preset", "tiny", "--stages", "2", "--inner-steps", "10",
        "--rounds", "1000", "--device", "cpu", "--progress", "lines", "--round-wait", "10", "--min-peers", "3",
        "--data-seed", str(index), "--set", "swarm.chunk_timeout=5.0", "--set", "swarm.allreduce_timeout=30.0",
        "--set", "inner.threads=1", *LIGHT_BATCH,
    ]  # fmt: skip


def status(name: str) -> dict | None:
    out = subprocess.run(["docker", "exec", name, "dilocox-peer", "status", "/data/run", "--json"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return json.loads(out.stdout) if out.returncode == 0 else None


def wait_for(name: str, what: str, ok, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = status(name)
        if last is not None and ok(last):
            return last
        state = docker("inspect", "-f", "{{.State.Running}} exit {{.State.ExitCode}} {{.State.Error}}", name).strip()
        assert state.startswith("true"), f"{name} stopped ({state}) before {what}:\n{logs_of(name)}"
        time.sleep(2.0)  # a poll (`docker exec` of the CLI, `docker inspect`) costs 0.34 CPU-s; a round takes 2-3 s
    raise AssertionError(f"{name}: not {what} within {timeout}s (last status {last}):\n{logs_of(name)}")


def logs_of(name: str, tail: int = 80) -> str:
    """The container's last lines, both streams (the peer logs to stderr, its progress lines go to stdout)."""
    out = subprocess.run(["docker", "logs", "--tail", str(tail), name], capture_output=True, text=True, timeout=60)
    return f"--- stdout\n{out.stdout}--- stderr\n{out.stderr}"


def hashes(s: dict, since: int = 0) -> dict[int, list[str]]:
    return {r["round"]: r["stage_hashes"] for r in s["recent_rounds"] if r["round"] >= since}


def assert_agree(statuses: dict[str, dict], *, since: int, at_least: int) -> None:
    """Every round that all these peers completed (since `since`) has the same per-stage hashes on each."""
    tables = {name: hashes(s, since) for name, s in statuses.items()}
    common = sorted(set.intersection(*(set(t) for t in tables.values())))
    assert len(common) >= at_least, f"too few rounds in common: {common} ({ {n: sorted(t) for n, t in tables.items()} })"
    for r in common:
        seen = {name: t[r] for name, t in tables.items()}
        assert len({json.dumps(v) for v in seen.values()}) == 1, f"round {r}: hashes differ {seen}"


def test_containers_agree_survive_a_kill_take_a_late_joiner_and_resume_from_their_volume(images, containers):
    boot = containers.run("boot", images["bootstrap"], "--host-maddrs", "/ip4/0.0.0.0/tcp/31337", volume="boot")
    deadline = time.monotonic() + 120
    while not (maddrs := docker("exec", boot, "cat", "/data/bootstrap/multiaddrs.txt", check=False).strip()):
        assert time.monotonic() < deadline, logs_of(boot)
        time.sleep(0.5)
    peer_id = re.search(r"/p2p/(\w+)", maddrs).group(1)
    initial = f"/dns4/{boot}/tcp/31337/p2p/{peer_id}"
    assert subprocess.run(["docker", "exec", boot, "dilocox-peer", "health", "/data/bootstrap"]).returncode == 0

    peers = [containers.run(f"p{i}", images["peer"], *_peer_args(initial, i), volume=f"p{i}", net_admin=True) for i in range(3)]
    for name in peers:  # each peer's egress through a token bucket, as on a real uplink
        docker("exec", "-u", "root", name, "tc", "qdisc", "add", "dev", "eth0", "root", *LINK)
        assert "tbf" in docker("exec", name, "tc", "qdisc", "show", "dev", "eth0")

    # 1. >= 5 rounds together: equal per-stage hashes at every round all three completed
    got = {n: wait_for(n, "at round 6", lambda s: s["round"] >= 6 and s["state"] == "training") for n in peers}
    got = {n: status(n) for n in peers}
    assert_agree(got, since=1, at_least=3)
    assert all(s["bytes_sent"] > 0 and s["stage_status"][0]["group_size"] >= 2 for s in got.values()), got
    p0, p1, p2 = peers

    # 2. a peer killed: the other two go on, in agreement
    docker("kill", p2)
    killed_at = status(p0)["round"]
    after = {n: wait_for(n, f"past round {killed_at + 4}", lambda s: s["round"] >= killed_at + 5) for n in (p0, p1)}
    assert_agree({n: status(n) for n in (p0, p1)}, since=killed_at + 2, at_least=2)
    assert all(s["stage_status"][0]["group_size"] == 2 for s in after.values()), after

    # 3. a late joiner catches up and agrees from then on
    joined_at = status(p0)["round"]
    p3 = containers.run("p3", images["peer"], *_peer_args(initial, 3), volume="p3", net_admin=True)
    docker("exec", "-u", "root", p3, "tc", "qdisc", "add", "dev", "eth0", "root", *LINK)
    late = wait_for(p3, "caught up and 3 rounds done", lambda s: s["round"] >= joined_at and len(s["recent_rounds"]) >= 3,
                    timeout=400)  # fmt: skip
    # p0 may be a round or two behind the joiner at this moment (a round of its own that waited for the joiner while
    # the joiner borrowed: CI run 173 read p0 at 19 and the joiner at 21); agreement is judged on rounds both did
    since = late["recent_rounds"][0]["round"]
    wait_for(p0, f"past round {since + 2}", lambda s: s["round"] >= since + 3)
    assert_agree({p0: status(p0), p3: status(p3)}, since=since, at_least=2)

    # 4. a peer container killed and started again on its volume resumes from its checkpoint
    before = status(p1)["round"]
    docker("kill", p1)
    # `docker kill` returns once the signal is sent: a `docker start` before the container stopped is a no-op on a
    # running container, which then stops for good (the official CI run of 36ca8ef: "exited" after the start)
    docker("wait", p1)
    docker("start", p1)
    docker("exec", "-u", "root", p1, "tc", "qdisc", "add", "dev", "eth0", "root", *LINK)
    back = wait_for(p1, "back in the swarm for 2 rounds", lambda s: len(s["recent_rounds"]) >= 2, timeout=400)
    logs = subprocess.run(["docker", "logs", p1], capture_output=True, text=True).stderr
    resumed = [int(m) for m in re.findall(r"resumed from round (\d+)", logs)]
    # the round in flight when the status was read may end, and be checkpointed, before the kill lands
    assert resumed and before - 2 <= resumed[-1] <= before + 1, (before, resumed)
    assert_agree({p0: status(p0), p1: status(p1)}, since=back["recent_rounds"][0]["round"], at_least=1)
    assert subprocess.run(["docker", "exec", p1, "dilocox-peer", "health", "/data/run"]).returncode == 0
