"""The control plane of a live peer: `dilocox-peer status`, gRPC health, Watch, Prometheus, JSON logs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dilocox_p2p.proto_gen import control_pb2, control_pb2_grpc

pytestmark = pytest.mark.swarm

ROUNDS = 200  # never reached: the peers are stopped once the checks are done (a run of 7 rounds, 8 s, ended before
# them once, beside a busy core: each `dilocox-peer status` starts an interpreter)


def _status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dilocox_p2p.cli", "status", *args], capture_output=True, text=True, timeout=60
    )


def _metrics_url(peer) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in peer.stage_log(0).splitlines():
            if "Prometheus metrics at" in line:
                return json.loads(line)["message"].split(" at ")[1]
        time.sleep(0.2)
    raise AssertionError(f"no metrics address logged:\n{peer.output()}")


def test_a_live_peer_reports_its_round_hashes_health_and_metrics_and_logs_json_lines(swarm):
    steps = ["--rounds", str(ROUNDS), "--inner-steps", "10", "--min-peers", "2"]
    a = swarm.start_peer(*steps, "--metrics-addr", "127.0.0.1:0", "--log-format", "json")
    b = swarm.start_peer(*steps)
    deadline = time.monotonic() + 120
    while not any(r["group_size"] == 2 for r in a.metrics()):  # b is in: rounds average, bytes flow
        assert time.monotonic() < deadline and a.proc.poll() is None, a.output()
        time.sleep(0.2)

    # status --json: the live round, and the hashes the peer's own records hold for it
    got = _status(str(a.run_dir), "--json")
    assert got.returncode == 0, got.stderr
    status = json.loads(got.stdout)
    assert status["state"] == "training" and status["run_id"] == swarm.run_id
    assert status["peer_id"].startswith("12D3KooW") and status["stages"] == 2
    done = {r["round"] + 1: r for r in a.metrics()}
    assert status["round"] in done, (status["round"], sorted(done))
    assert status["stage_hashes"] == done[status["round"]]["stage_hashes"]
    assert [s["state_hash"] for s in status["stage_status"]] == status["stage_hashes"]
    recent = status["recent_rounds"]
    assert recent[-1]["round"] == status["round"] - 1 and recent[-1]["stage_hashes"] == status["stage_hashes"]
    assert all(done[r["round"] + 1]["stage_hashes"] == r["stage_hashes"] for r in recent)
    assert status["bytes_sent"] > 0 and status["val_loss"] is not None
    text = _status(str(a.run_dir))
    assert text.returncode == 0 and "state training: round" in text.stdout and "stage 1: hash" in text.stdout, text

    address = (a.run_dir / "control.addr").read_text().strip()
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # Watch: the next completed round arrives as an event carrying its metrics record
        events = control_pb2_grpc.PeerControlStub(channel).Watch(control_pb2.WatchRequest(), timeout=60)
        event = next(e for e in events if e.event == "round")
        events.cancel()
        record = json.loads(event.record_json)
        assert record["round"] == event.round and len(record["stage_hashes"]) == 2

    body = urllib.request.urlopen(_metrics_url(a), timeout=10).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in body.splitlines() if line and line[0] != "#"}
    assert values["dilocox_bytes_sent_total"] > 0 and values["dilocox_tokens_total"] > 0
    assert values["dilocox_round"] >= 2 and values['dilocox_state{dilocox_state="training"}'] == 1.0

    # both peers averaged together: equal hashes at a round both completed
    b.wait_for_round(3, timeout=120)
    rounds_b = {r["round"]: r for r in b.metrics()}
    shared = [r for r in a.metrics() if r["round"] in rounds_b and r["group_size"] == 2]
    assert shared and all(r["stage_hashes"] == rounds_b[r["round"]]["stage_hashes"] for r in shared[-1:])

    for peer in (a, b):
        peer.signal(signal.SIGTERM)
    assert a.wait(180) == 128 + signal.SIGTERM and b.wait(180) == 128 + signal.SIGTERM
    # one JSON object per log line, naming peer, stage and round
    lines = [json.loads(line) for line in a.stage_log(0).splitlines()]
    assert lines and all({"time", "level", "logger", "message", "stage"} <= set(line) for line in lines)
    final = [line for line in lines if line["message"] == "peer state: stopped"]
    assert final and final[0]["round"] >= status["round"] and final[0]["peer"] == status["peer_id"]
    gone = _status(str(a.run_dir))
    assert gone.returncode == 2 and len(gone.stderr.strip().splitlines()) == 1 and "not running" in gone.stderr
