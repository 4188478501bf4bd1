"""The control plane's parts without a peer: the status board, its Prometheus figures, the status CLI's errors."""

from __future__ import annotations

import json
import logging
import math
import socket
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry, generate_latest

from dilocox_p2p.cli.__main__ import main
from dilocox_p2p.config import Config
from dilocox_p2p.control import StatusBoard, StatusCollector, compression_ratio
from dilocox_p2p.endpoints import GrpcEndpoint, bindable, free_ports
from dilocox_p2p.identity import public_raw
from tests.helpers.bootstrap import free_port

pytestmark = pytest.mark.unit


def _record(round: int, *, sent: int, faults: dict[str, int] | None = None) -> dict:
    return {
        "round": round, "train_loss": 2.5, "val_loss": 2.6, "tokens": 1000 * (round + 1), "tokens_per_s": 500.0,
        "seconds_comm_wait": 0.1, "bytes_sent": sent, "bytes_received": sent, "stage_hashes": ["aa", "bb"],
        "group_sizes": [3, 3], "kinds": ["exact", "exact"], "fp32_bytes": [3000, 3000], "faults": faults or {},
    }  # fmt: skip


def test_compression_ratio_compares_bytes_sent_with_an_fp32_butterfly_in_the_same_groups():
    # fp32 butterfly of n=3: each peer sends 2 (n-1)/n of its bytes: 2 stages x 3000 x 4/3 = 8000
    assert compression_ratio(_record(0, sent=8000)) == pytest.approx(1.0)
    assert compression_ratio(_record(0, sent=1000)) == pytest.approx(8.0)
    assert compression_ratio(_record(0, sent=0)) == 0.0
    assert compression_ratio({**_record(0, sent=100), "group_sizes": [1, None]}) == 0.0  # alone: nothing to compare


def test_the_board_adds_up_bytes_and_faults_and_streams_every_round_to_each_watcher():
    board = StatusBoard(Config(), rounds=10, steps=5)
    assert math.isnan(board.snapshot().val_loss) and board.snapshot().state == "starting"
    watcher = board.subscribe(include_current=False)
    board.set_state("training")
    board.step(0, 3)
    assert board.snapshot().step == 3
    board.round_done(_record(0, sent=1000, faults={"repairs": 1}), members=[["a", "b"], ["a"]])
    board.round_done(_record(1, sent=500, faults={"repairs": 2}))
    s = board.snapshot()
    assert (s.round, s.step, s.bytes_sent, s.faults["repairs"]) == (2, 0, 1500, 3)
    assert s.stage_hashes == ["aa", "bb"] and s.stage_status[0].group_size == 3
    assert [r.round for r in s.recent_rounds] == [0, 1] and s.recent_rounds[1].stage_hashes == ["aa", "bb"]
    events = [watcher.get_nowait() for _ in range(3)]
    assert [e.event for e in events] == ["state", "round", "round"]
    assert json.loads(events[2].record_json)["round"] == 1
    late = board.subscribe(include_current=True)  # a late watcher first gets the last round
    assert late.get_nowait().round == 1
    board.close_watchers()
    assert watcher.get_nowait() is None


def test_a_watcher_that_does_not_read_loses_old_events_and_never_blocks_training():
    board = StatusBoard(Config(), rounds=1000, steps=1)
    q = board.subscribe(include_current=False)
    for t in range(300):
        board.round_done(_record(t, sent=10))
    assert q.full() and q.get_nowait().round > 0
    recent = board.snapshot().recent_rounds
    assert [r.round for r in recent] == list(range(284, 300))  # the last 16, oldest first


def test_prometheus_figures_are_the_boards():
    board = StatusBoard(Config(), rounds=10, steps=5)
    board.set_state("training")
    board.round_done(_record(0, sent=1000, faults={"repairs": 1}))
    registry = CollectorRegistry()
    registry.register(StatusCollector(board))
    text = generate_latest(registry).decode()
    assert "dilocox_bytes_sent_total 1000.0" in text and "dilocox_round 1.0" in text
    assert 'dilocox_faults_total{kind="repairs"} 1.0' in text and 'dilocox_state{dilocox_state="training"} 1.0' in text
    assert 'dilocox_group_size{stage="1"} 3.0' in text
    last = next(line for line in text.splitlines() if line.startswith("dilocox_last_round_time_seconds "))
    assert float(last.split()[1]) == board.snapshot().last_round_at > 0


def test_a_client_member_stage_is_named_so_in_status_and_in_prometheus():
    from dilocox_p2p.cli.status import render

    board = StatusBoard(Config(), rounds=10, steps=5)
    board.round_done({**_record(0, sent=1000), "clients": ["", "the swarm cannot dial it (behind a NAT)"]},
                     members=[["a", "b"], ["a", "b"]])  # fmt: skip
    lines = render(board.snapshot()).splitlines()
    stage0, stage1 = (next(line for line in lines if line.startswith(f"stage {i}:")) for i in (0, 1))
    assert "client member" not in stage0 and stage1.endswith("client member: the swarm cannot dial it (behind a NAT)")
    registry = CollectorRegistry()
    registry.register(StatusCollector(board))
    text = generate_latest(registry).decode()
    assert 'dilocox_client_member{stage="0"} 0.0' in text and 'dilocox_client_member{stage="1"} 1.0' in text


def test_the_share_of_a_compressed_message_the_average_counted_is_shown_per_stage_in_status_and_prometheus():
    from dilocox_p2p.cli.status import render

    board = StatusBoard(Config(), rounds=10, steps=5)
    board.round_done({**_record(0, sent=1000), "counted_shares": [1.0, 2 / 3]}, members=[["a"], ["a"]])
    lines = render(board.snapshot()).splitlines()
    stage0, stage1 = (next(line for line in lines if line.startswith(f"stage {i}:")) for i in (0, 1))
    assert "(exact, 100% of its message counted)" in stage0 and "(exact, 67% of its message counted)" in stage1
    registry = CollectorRegistry()
    registry.register(StatusCollector(board))
    text = generate_latest(registry).decode()
    assert 'dilocox_counted_share{stage="1"} 0.666' in text
    board.round_done({**_record(1, sent=1000), "counted_shares": [None, None]})  # fp32: nothing to count
    assert "counted" not in render(board.snapshot())
    registry = CollectorRegistry()
    registry.register(StatusCollector(board))
    assert "dilocox_counted_share{" not in generate_latest(registry).decode()


def _one_line_error(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_status_of_a_dead_or_wrong_target_is_one_line_and_exit_2(capsys, tmp_path):
    assert "no dilocox peer answers" in _one_line_error(capsys, ["status", "--target", f"127.0.0.1:{free_port()}"])
    assert "not running" in _one_line_error(capsys, ["status", str(tmp_path)])
    assert "not a directory" in _one_line_error(capsys, ["status", str(tmp_path / "nope")])
    assert "HOST:PORT" in _one_line_error(capsys, ["status", "--target", "localhost"])
    assert "name the peer" in _one_line_error(capsys, ["status"])
    other = GrpcEndpoint.start("127.0.0.1:0", flag="--x")  # a gRPC server that is not a peer's control plane
    try:
        assert "not a dilocox peer" in _one_line_error(capsys, ["status", "--target", other.address])
    finally:
        other.stop(0)


def test_join_refuses_a_control_or_metrics_port_in_use_before_starting_any_stage(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag in ("--control-addr", "--metrics-addr"):
            err = _one_line_error(capsys, ["join", "--no-swarm", "--run-dir", str(tmp_path / "r"), flag, f"127.0.0.1:{port}"])
            assert "in use" in err and flag in err
    assert not (tmp_path / "r").exists()
    assert "HOST:PORT" in _one_line_error(capsys, ["join", "--no-swarm", "--control-addr", "nowhere"])


def test_health_exits_0_while_serving_and_1_when_not_or_unreachable(capsys, tmp_path):
    endpoint = GrpcEndpoint.start("127.0.0.1:0", flag="--x")
    try:
        (tmp_path / "health.addr").write_text(endpoint.address + "\n")
        assert main(["health", str(tmp_path)]) == 0
        endpoint.set_serving(False)
        assert main(["health", "--target", endpoint.address]) == 1
        assert "NOT_SERVING" in capsys.readouterr().err
    finally:
        endpoint.stop(0)
    assert main(["health", "--target", f"127.0.0.1:{free_port()}"]) == 1
    assert "unavailable" in capsys.readouterr().err
    assert "holds no control.addr or health.addr" in _one_line_error(capsys, ["health", str(tmp_path / "empty")])


def test_ports_picked_for_a_random_address_lie_below_the_kernels_ephemeral_range_and_are_free():
    # the kernel hands out ports of that range to outgoing connections: one took a stage's port before it listened
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(20):
        port = free_ports("127.0.0.1", 4)
        assert 10_000 <= port and port + 3 < low
        assert all(bindable("127.0.0.1", port + i) for i in range(4))


def test_a_flood_of_idle_watch_streams_is_capped_and_get_status_and_health_still_answer(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from dilocox_p2p.control import GRPC_THREADS, MAX_WATCHERS, ControlPlane
    from dilocox_p2p.proto_gen import control_pb2, control_pb2_grpc

    board = StatusBoard(Config(), rounds=3, steps=2)
    plane = ControlPlane.start(Config(), board, tmp_path)
    channel = grpc.insecure_channel(plane.grpc.address)
    streams = []
    try:
        stub = control_pb2_grpc.PeerControlStub(channel)
        # as many idle streams as the server has threads: they held every one, and GetStatus and health timed out
        board.round_done(_record(0, sent=100))  # a stream that is taken starts with this round's event
        streams = [stub.Watch(control_pb2.WatchRequest(include_current=True), timeout=10) for _ in range(GRPC_THREADS)]
        outcomes = []
        for stream in streams:
            try:
                outcomes.append(next(stream).event)
            except grpc.RpcError as e:
                outcomes.append(e.code())
        assert outcomes.count("round") == MAX_WATCHERS, outcomes
        assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == GRPC_THREADS - MAX_WATCHERS

        assert stub.GetStatus(control_pb2.StatusRequest(), timeout=5).round == 1
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for stream in streams:
            stream.cancel()
        channel.close()
        plane.close("finished")


OPERATOR = public_raw(Ed25519PrivateKey.generate()).hex()


@pytest.mark.parametrize(("addr", "keys", "warned"), [("127.0.0.1:0", (), False), ("0.0.0.0:0", (), True),
                                                      ("0.0.0.0:0", (OPERATOR,), False)])
def test_a_control_plane_bound_beyond_loopback_without_operator_keys_warns_that_it_serves_loopback_only(
    tmp_path, caplog, addr, keys, warned
):
    from dilocox_p2p.config import load_config
    from dilocox_p2p.control import ControlPlane

    cfg = load_config(overrides={"control.control_addr": addr, "control.operator_keys": list(keys)})
    plane = ControlPlane.start(cfg, StatusBoard(cfg, rounds=1, steps=1), tmp_path)
    plane.close("finished")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]  # hivemind renames it WARN
    assert any("--control-addr 0.0.0.0:" in w and "requests from other hosts are refused" in w for w in warnings) == warned, warnings
