"""`dilocox-peer doctor`'s pure rules: address scopes, announce addresses, memory, disk, clock; and a run
with no initial peers (no network needed).

Run: python -m pytest tests/unit/test_doctor.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dilocox_p2p.cli.__main__ import main
from dilocox_p2p.config import PRESETS
from dilocox_p2p.doctor import (
    Check,
    address_scope,
    announce_checks,
    clock_check,
    disk_check,
    hello_verdict,
    listen_hostport,
    memory_check,
    parse_peer_maddr,
)
from dilocox_p2p.memory_estimate import CHECKPOINT_BYTES_PER_PARAM, estimate_memory
from dilocox_p2p.model import unit_param_counts
from dilocox_p2p.proto_gen.control_pb2 import HelloReply

pytestmark = pytest.mark.unit

PEER_ID = "12D3KooWSnrTn5ipvycxD4nuWWtjCx1JEG8fdZZBdgyFFhgwiSG5"


@pytest.mark.parametrize(
    "host, scope",
    [
        ("127.0.0.1", "loopback"), ("::1", "loopback"), ("localhost", "loopback"),
        ("10.1.2.3", "private"), ("172.16.0.9", "private"), ("192.168.1.20", "private"),
        ("169.254.3.4", "private"), ("100.64.0.1", "private"), ("fd00::1", "private"), ("fe80::1", "private"),
        ("8.8.8.8", "public"), ("2001:4860:4860::8888", "public"),
        ("0.0.0.0", "unspecified"), ("::", "unspecified"), ("boot.example.org", "name"),
    ],
)  # fmt: skip
def test_address_scope_tells_loopback_lan_internet_and_names_apart(host, scope):
    assert address_scope(host) == scope


def test_a_complete_initial_peer_address_parses_and_an_incomplete_one_says_what_is_missing():
    addr = parse_peer_maddr(f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER_ID}")
    assert (addr.host, addr.port, addr.peer_id) == ("203.0.113.7", 31337, PEER_ID)
    assert str(addr.dial_maddr) == "/ip4/203.0.113.7/tcp/31337"
    assert parse_peer_maddr(f"/dns/boot.example.org/tcp/31337/p2p/{PEER_ID}").host == "boot.example.org"
    for text, why in [
        ("/ip4/203.0.113.7/tcp/31337", "lacks the peer id"),
        (f"/ip4/203.0.113.7/udp/31337/quic/p2p/{PEER_ID}", "names no TCP port"),
        (f"/ip4/203.0.113.7/tcp/0/p2p/{PEER_ID}", "port 0"),
        (f"/p2p/{PEER_ID}", "names no host"),
        ("203.0.113.7:31337", "not a multiaddr"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_peer_maddr(text)


def test_listen_hostport_names_only_fixed_tcp_ports():
    assert listen_hostport("/ip4/0.0.0.0/tcp/31337") == ("0.0.0.0", 31337)
    assert listen_hostport("/ip6/::/tcp/4000") == ("::", 4000)
    assert listen_hostport("/ip4/0.0.0.0/tcp/0") is None
    assert listen_hostport("/ip4/0.0.0.0/udp/4000/quic") is None


def _only(checks: list[Check]) -> Check:
    assert len(checks) == 1, checks
    return checks[0]


def test_a_loopback_announce_address_fails_when_an_initial_peer_is_on_another_machine():
    check = _only(announce_checks(["203.0.113.7"], ["/ip4/127.0.0.1/tcp/4000"], ["/ip4/0.0.0.0/tcp/4000"],
                                  auto_relay=False, route_source="192.168.1.20"))  # fmt: skip
    assert check.status == "FAIL" and "loopback" in check.detail and "203.0.113.7" in check.detail
    assert "--announce-maddrs /ip4/192.168.1.20/tcp/4000" in check.fix
    # on one machine (the swarm tier), loopback is right
    assert _only(announce_checks(["127.0.0.1"], ["/ip4/127.0.0.1/tcp/4000"], ["/ip4/127.0.0.1/tcp/4000"],
                                 auto_relay=False, route_source=None)).status == "PASS"  # fmt: skip


def test_a_private_announce_address_fails_against_a_public_initial_peer_but_passes_on_a_lan():
    check = _only(announce_checks(["8.8.8.8"], ["/ip4/10.0.0.5/tcp/4000"], ["/ip4/0.0.0.0/tcp/4000"],
                                  auto_relay=False, route_source="10.0.0.5"))  # fmt: skip
    assert check.status == "FAIL" and "private" in check.detail
    assert "forward TCP port 4000" in check.fix and "--announce-maddrs /ip4/PUBLIC_IP/tcp/4000" in check.fix
    assert "--auto-relay" in check.fix
    assert _only(announce_checks(["10.0.0.9"], ["/ip4/10.0.0.5/tcp/4000"], ["/ip4/0.0.0.0/tcp/4000"],
                                 auto_relay=False, route_source="10.0.0.5")).status == "PASS"  # fmt: skip


def test_an_announce_address_with_port_0_fails():
    check = _only(announce_checks(["8.8.8.8"], ["/ip4/8.8.4.4/tcp/0"], ["/ip4/0.0.0.0/tcp/0"],
                                  auto_relay=False, route_source="8.8.4.4"))  # fmt: skip
    assert check.status == "FAIL" and "port 0" in check.detail


def test_behind_nat_without_announce_address_warns_with_both_fixes_unless_auto_relay():
    args = (["8.8.8.8"], [], ["/ip4/0.0.0.0/tcp/0"])
    warn = _only(announce_checks(*args, auto_relay=False, route_source="192.168.1.20"))
    assert warn.status == "WARN" and "no public address" in warn.detail and "192.168.1.20" in warn.detail
    assert "--announce-maddrs /ip4/PUBLIC_IP/tcp/PORT" in warn.fix and "--auto-relay" in warn.fix
    assert _only(announce_checks(*args, auto_relay=True, route_source="192.168.1.20")).status == "PASS"
    assert _only(announce_checks(*args, auto_relay=False, route_source="8.8.4.4")).status == "PASS"
    assert _only(announce_checks([], [], ["/ip4/0.0.0.0/tcp/0"], auto_relay=False, route_source=None)).status == "PASS"


def test_listening_on_loopback_only_fails_when_an_initial_peer_is_on_another_machine():
    check = _only(announce_checks(["10.0.0.9"], [], ["/ip4/127.0.0.1/tcp/31337"], auto_relay=False, route_source=None))
    assert check.status == "FAIL" and "loopback only" in check.detail
    assert check.fix == "pass --host-maddrs /ip4/0.0.0.0/tcp/31337"


def test_memory_estimate_counts_the_preset_parameters_at_the_stated_bytes_per_parameter():
    shape = PRESETS["tiny"]
    total = sum(unit_param_counts(shape))
    one = estimate_memory(shape, 1, on_cuda=False, checkpoints_kept=2)
    assert one.stage_params == (total,)
    assert one.device_bytes == (16 * total,)  # fp32 weights, grads, AdamW m and v
    assert one.host_bytes == 32 * total  # on CPU: the device's 16 plus theta_g, momentum, pending, averager copy
    assert one.checkpoint_bytes == 3 * total * sum(CHECKPOINT_BYTES_PER_PARAM.values())
    two = estimate_memory(shape, 2, on_cuda=True, checkpoints_kept=2)
    assert sum(two.stage_params) == total and len(two.device_bytes) == 2
    assert two.host_bytes == 16 * total  # on CUDA the device's share is on the GPU
    big = estimate_memory(PRESETS["1b"], 4, on_cuda=True, checkpoints_kept=2)
    assert 0.9e9 < sum(big.stage_params) < 1.2e9
    assert max(big.device_bytes) < 0.3 * 16 * sum(big.stage_params)  # balanced: about a quarter each


def test_the_ram_check_of_a_peer_with_replicas_on_cpu_counts_every_copy_of_its_stages(tmp_path):
    from dilocox_p2p.config import load_config
    from dilocox_p2p.doctor import memory_checks
    from dilocox_p2p.memory_estimate import gib

    def ram(replicas: int):
        cfg = load_config(overrides={"run.device": "cpu", "run.replicas": replicas, "model.preset": "small",
                                     "run.run_dir": str(tmp_path / "run"), "inner.batch_size": 16})  # fmt: skip
        return next(c for c in memory_checks(cfg) if c.what.startswith("RAM"))

    one, two = ram(1), ram(2)
    est = estimate_memory(PRESETS["small"], 2, on_cuda=False, checkpoints_kept=2)
    assert f"needs ~{gib(est.host_bytes)} " in one.detail and "replicas" not in one.what
    # the copies of replica 1 train in RAM too: their weights, gradients and AdamW moments; theta_g is replica 0's
    assert f"needs ~{gib(est.host_bytes + sum(est.device_bytes))} " in two.detail and "x 2 replicas" in two.what


def test_memory_and_disk_checks_fail_over_the_free_amount_and_warn_near_it():
    assert memory_check("RAM", 10, 9, basis="b").status == "FAIL"
    assert memory_check("RAM", 9, 10, basis="b").status == "WARN"
    ok = memory_check("RAM", 2**30, 8 * 2**30, basis="16 B/param")
    assert ok.status == "PASS" and "1.00 GiB" in ok.detail and "8.00 GiB free" in ok.detail
    assert "--stages" in memory_check("RAM", 10, 9, basis="b").fix
    full = disk_check(Path("runs/x"), 10, 9, checkpoints_kept=2)
    assert full.status == "FAIL" and "--run-dir" in full.fix
    assert disk_check(Path("runs/x"), 9, 10, checkpoints_kept=2).status == "PASS"


def test_clock_check_bounds_the_offset_against_peers_and_without_peers_the_year():
    assert clock_check({}, now=0.0).status == "FAIL"  # 1970
    assert "1970" in clock_check({}, now=0.0).detail and "ntp" in clock_check({}, now=0.0).fix
    assert clock_check({}, now=1_800_000_000.0).status == "PASS"
    bad = clock_check({"a": 0.4, "b": -12.5}, now=1_800_000_000.0)
    assert bad.status == "FAIL" and "-12.50 s against b" in bad.detail
    assert clock_check({"a": 0.4, "b": -9.0}, now=1_800_000_000.0).status == "PASS"


def test_hello_verdict_tells_other_software_other_protocols_and_other_runs_apart():
    def verdict(**fields):
        reply = HelloReply(**{"software": "dilocox-p2p", "version": "0.1.0", "protocol": 1, "role": "bootstrap", **fields})
        return hello_verdict("initial peer X", reply, ours=1, run_id="mine", round_trip=0.004)

    ok = verdict()
    assert ok.status == "PASS" and ok.detail == "dilocox bootstrap 0.1.0, protocol 1, round trip 4 ms"
    newer = verdict(protocol=2, version="0.2.0")
    assert newer.status == "FAIL" and "runs incompatible version 0.2.0 (protocol 2, ours 1)" in newer.detail
    assert "upgrade dilocox-p2p on this machine" in newer.fix
    assert "on that node" in hello_verdict("x", HelloReply(software="dilocox-p2p", protocol=0), ours=1, run_id="",
                                           round_trip=0).fix  # fmt: skip
    other = hello_verdict("x", HelloReply(software="something-else", protocol=1), ours=1, run_id="", round_trip=0)
    assert other.status == "FAIL" and "not a dilocox node" in other.detail
    elsewhere = verdict(role="peer", run_id="theirs")
    assert elsewhere.status == "WARN" and "trains run 'theirs', not 'mine'" in elsewhere.detail
    assert verdict(role="peer", run_id="mine").status == "PASS"


def test_check_lines_name_status_what_problem_and_fix():
    check = Check("FAIL", "port 0.0.0.0:31337 free", "in use", "stop it")
    assert check.line() == "FAIL  port 0.0.0.0:31337 free: in use. Fix: stop it"
    assert check.as_dict() == {"status": "FAIL", "what": "port 0.0.0.0:31337 free", "detail": "in use", "fix": "stop it"}


def test_doctor_without_initial_peers_passes_and_prints_json(capsys, tmp_path):
    code = main(["doctor", "--json", "--run-dir", str(tmp_path / "run"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                 "--preset", "tiny", "--device", "cpu"])  # fmt: skip
    checks = json.loads(capsys.readouterr().out)
    assert code == 0, checks
    assert {c["status"] for c in checks} == {"PASS"}
    whats = " | ".join(c["what"] for c in checks)
    for topic in ("ports", "announce address", "clock", "RAM", "disk for checkpoints"):
        assert topic in whats


def test_a_peer_without_a_swarm_checks_its_ports_without_loading_hivemind(tmp_path):
    # `join --no-swarm` (one cluster alone; the benchmarks on a GPU machine) runs where hivemind is not installed
    code = (
        "import sys; from dilocox_p2p.config import load_config; from dilocox_p2p.launch import _check_ports; "
        "_check_ports(load_config(overrides={'swarm.enabled': False, 'run.run_dir': sys.argv[1]})); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'hivemind'))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_reachability_verdict_names_the_nat_the_refused_port_and_the_fix():
    from dilocox_p2p.proto_gen.control_pb2 import DialBackReply, PortReach
    from dilocox_p2p.swarm.dial_back import observed_host, reachability_verdict

    assert observed_host("/ip4/198.51.100.4/tcp/4001") == "198.51.100.4"
    assert observed_host("/ip6/2001:db8::7/tcp/4001") == "2001:db8::7"
    assert observed_host("/ip4/198.51.100.4/tcp/4001/p2p/12D3KooWPfUv6gf1EiQqcHcf457i1pkpsjdMW9R8F92hbH4DMNfZ/p2p-circuit") == ""
    assert observed_host("garbage") == ""
    open_ = DialBackReply(observed_host="198.51.100.4", ports=[PortReach(port=31400, reachable=True)])
    check = reachability_verdict(open_, asked=[31400], local_host="198.51.100.4", via="initial peer 203.0.113.1")
    assert check.status == "PASS" and "198.51.100.4 at port(s) 31400" in check.detail
    shut = DialBackReply(observed_host="198.51.100.4", ports=[PortReach(port=31400, error="refused")])
    check = reachability_verdict(shut, asked=[31400], local_host="192.168.1.20", via="initial peer 203.0.113.1",
                                 picked=True)  # fmt: skip
    assert check.status == "WARN"
    assert "behind a NAT (its address 192.168.1.20; the swarm sees 198.51.100.4)" in check.detail
    assert "198.51.100.4:31400 refused" in check.detail
    assert "forward TCP port 31400" in check.fix and "--host-maddrs /ip4/0.0.0.0/tcp/31400" in check.fix
    assert "it averages as a client member" in check.detail  # what happens meanwhile (swarm.reachability = auto)
    full = reachability_verdict(shut, asked=[31400], local_host="192.168.1.20", via="x", reachability="public")
    assert "still averages as a full member" in full.detail and "it averages as a client member" not in full.detail
    relayed = reachability_verdict(DialBackReply(), asked=[31400], local_host=None, via="x")
    assert relayed.status == "WARN" and "relay" in relayed.detail
