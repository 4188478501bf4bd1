"""Wire messages: checked decoding and the generated code being up to date.

    pytest tests/unit/test_wire.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dilocox_p2p.endpoints import stage_maddr
from dilocox_p2p.errors import WireRejected
from dilocox_p2p.wire import decode, encode, swarm_pb2

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_a_record_survives_encode_and_decode():
    record = swarm_pb2.RoundRecord(boundary=7, state_hash="ab" * 32, pending_hash="cd" * 32, group_size=3, coverage=1.0)
    assert decode(swarm_pb2.RoundRecord, encode(record)) == record


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        ("not bytes", "expected bytes"),
        (b"\xff\xff\xff\xff", "malformed"),
        (encode(swarm_pb2.RoundRecord(boundary=1, coverage=float("nan"))), "non-finite coverage"),
        (b"\x0a" + b"\x00" * 70_000, "70001 bytes > limit"),
    ],
)
def test_unacceptable_bytes_are_refused_with_the_reason(blob, reason):
    with pytest.raises(WireRejected, match=reason):
        decode(swarm_pb2.RoundRecord, blob)


def test_stage_s_listens_on_port_plus_s_and_random_ports_stay_random():
    assert stage_maddr("/ip4/0.0.0.0/tcp/31337", 2) == "/ip4/0.0.0.0/tcp/31339"
    assert stage_maddr("/ip4/0.0.0.0/tcp/0", 3) == "/ip4/0.0.0.0/tcp/0"
    assert stage_maddr("/dns4/node1/tcp/4000", 1) == "/dns4/node1/tcp/4001"


def test_only_a_node_listening_on_loopback_alone_skips_nat_port_mapping():
    from dilocox_p2p.endpoints import loopback_only

    assert loopback_only(["/ip4/127.0.0.1/tcp/0"]) and loopback_only(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"])
    assert not loopback_only(["/ip4/0.0.0.0/tcp/0"]) and not loopback_only(["/ip4/127.0.0.1/tcp/0", "/ip4/10.0.0.2/tcp/0"])
    assert not loopback_only(["/dns4/localhost/tcp/4000"]) and not loopback_only([])


def test_generated_protobuf_code_matches_the_schemas():
    result = subprocess.run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
