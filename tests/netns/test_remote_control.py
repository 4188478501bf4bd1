"""A peer's control plane read from another host: an operator whose key the peer lists is served; unsigned,
unlisted, replayed and tampered requests are refused, each counted; this machine's own CLI still needs no key.

    sudo pytest tests/netns/test_remote_control.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.netlab import NetLab
from dilocox_p2p.identity import public_raw, write_identity

pytestmark = pytest.mark.netns

PORT = 7100
STARTED_S = 120.0

# run on the operator's host: the same request sent four ways through a real gRPC channel, each outcome printed
CLIENT = """
import json, sys
import grpc
from pathlib import Path
from dilocox_p2p.control_auth import METADATA_KEY, signed_metadata
from dilocox_p2p.identity import load_identity
from dilocox_p2p.proto_gen import control_pb2, control_pb2_grpc, envelope_pb2

target, key_file = sys.argv[1], Path(sys.argv[2])
key, request, method = load_identity(key_file), control_pb2.StatusRequest(), "/dilocox.v1.PeerControl/GetStatus"

def call(metadata):
    with grpc.insecure_channel(target) as channel:
        try:
            status = control_pb2_grpc.PeerControlStub(channel).GetStatus(request, timeout=10, metadata=metadata)
            return {"ok": status.run_id}
        except grpc.RpcError as e:
            return {"code": e.code().name, "details": e.details()}

signed = signed_metadata(key, method, request)
first, replayed = call(signed), call(signed)
outer = envelope_pb2.SignedEnvelope.FromString(signed[0][1])
body = envelope_pb2.Envelope.FromString(outer.body)
body.sent_at += 1.0  # a byte of the signed body changed on the way
tampered = envelope_pb2.SignedEnvelope(body=body.SerializeToString(), signature=outer.signature).SerializeToString()
print(json.dumps({"first": first, "replayed": replayed, "tampered": call([(METADATA_KEY, tampered)])}))
"""


def _cli(lab: NetLab, host: int, *args: str) -> subprocess.CompletedProcess:
    proc = lab.popen(host, [sys.executable, "-m", "dilocox_p2p.cli", *args], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_an_operator_reads_a_peer_from_another_host_and_everyone_else_is_refused_and_counted(tmp_path):
    operator, stranger = tmp_path / "operator.key", tmp_path / "stranger.key"
    listed = public_raw(write_identity(operator)).hex()
    write_identity(stranger)
    with NetLab(n_hosts=2, rate_mbit=None) as lab:
        log = open(tmp_path / "peer.out", "w")
        peer = lab.popen(0, [sys.executable, "-m", "dilocox_p2p.cli", "join", "--no-swarm", "--run-id", "remote",
                             "--preset", "tiny", "--device", "cpu", "--rounds", "1000", "--inner-steps", "5",
                             "--progress", "off", "--run-dir", str(tmp_path / "peer"), "--set", "inner.threads=1",
                             "--control-addr", f"0.0.0.0:{PORT}", "--operator-keys", listed],
                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + STARTED_S
            while _cli(lab, 0, "status", str(tmp_path / "peer"), "--json").returncode != 0:
                assert peer.poll() is None and time.monotonic() < deadline, (tmp_path / "peer.out").read_text()[-3000:]
                time.sleep(0.5)
            target = f"{lab.ip(0)}:{PORT}"

            served = _cli(lab, 1, "status", "--target", target, "--operator-key", str(operator), "--json")
            assert served.returncode == 0, served.stderr
            assert json.loads(served.stdout)["run_id"] == "remote"
            unsigned = _cli(lab, 1, "status", "--target", target)
            assert unsigned.returncode != 0 and "carries no operator signature" in unsigned.stderr, unsigned.stderr
            assert "--operator-key" in unsigned.stderr  # the error names the fix
            unlisted = _cli(lab, 1, "status", "--target", target, "--operator-key", str(stranger))
            assert unlisted.returncode != 0 and "is not in control.operator_keys" in unlisted.stderr, unlisted.stderr

            client = lab.popen(1, [sys.executable, "-c", CLIENT, target, str(operator)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=str(Path.cwd()))  # fmt: skip
            out, err = client.communicate(timeout=60)
            assert client.returncode == 0, err
            calls = json.loads(out)
            assert calls["first"] == {"ok": "remote"}, calls
            assert calls["replayed"]["code"] == "PERMISSION_DENIED" and "replayed" in calls["replayed"]["details"]
            assert calls["tampered"]["code"] == "PERMISSION_DENIED" and "does not verify" in calls["tampered"]["details"]

            # this machine's own CLI needs no key, and sees each refusal counted: unsigned, unlisted, replay, tamper
            local = _cli(lab, 0, "status", str(tmp_path / "peer"), "--json")
            assert local.returncode == 0, local.stderr
            assert json.loads(local.stdout)["faults"].get("control_refused") == 4, local.stdout
            assert "refused 1 control request(s)" in (tmp_path / "peer.out").read_text()
        finally:
            peer.terminate()
            peer.wait(60)
