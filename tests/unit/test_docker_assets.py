"""docker/: the commands the Dockerfile and compose file run are ones our CLIs accept, and the config loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from dilocox_p2p.cli.__main__ import build_parser as peer_parser
from dilocox_p2p.cli.bootstrap import build_parser as bootstrap_parser
from dilocox_p2p.config import load_config

pytestmark = pytest.mark.unit

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _instructions(target: str) -> dict[str, list[str]]:
    """ENTRYPOINT / CMD / HEALTHCHECK of one build target of the Dockerfile (JSON exec form)."""
    text = DOCKER.joinpath("Dockerfile").read_text().replace("\\\n", " ")
    stage = text.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
    found = {}
    for line in stage.splitlines():
        match = re.match(r"(ENTRYPOINT|CMD|HEALTHCHECK)\s+(.*)", line)
        if match:
            body = match.group(2)
            found[match.group(1)] = json.loads(body[body.index("["):])
    return found


def _parses(parser, argv: list[str]) -> None:
    parser.parse_args(argv)  # SystemExit (a usage error) fails the test


def test_the_peer_image_runs_a_join_our_cli_accepts_and_checks_health_with_it():
    peer = _instructions("peer")
    assert peer["ENTRYPOINT"] == ["dilocox-peer"]
    args = peer_parser().parse_args(peer["CMD"])
    assert args.command == "join" and args.resume == "auto" and args.run_dir == "/data/run"
    assert peer["HEALTHCHECK"][:2] == ["dilocox-peer", "health"]
    _parses(peer_parser(), peer["HEALTHCHECK"][1:])


def test_the_bootstrap_image_runs_a_bootstrap_node_our_cli_accepts():
    boot = _instructions("bootstrap")
    assert boot["ENTRYPOINT"][0] == "dilocox-bootstrap"
    _parses(bootstrap_parser(), boot["ENTRYPOINT"][1:] + boot["CMD"])
    _parses(peer_parser(), boot["HEALTHCHECK"][1:])
    assert boot["HEALTHCHECK"][2] == "/data/bootstrap" == boot["ENTRYPOINT"][2]


def test_compose_services_run_commands_our_clis_accept_with_the_mounted_config():
    compose = yaml.safe_load(DOCKER.joinpath("compose.yaml").read_text())
    services = compose["services"]
    assert {"bootstrap", "peer1", "peer2", "peer3"} <= set(services)
    _parses(bootstrap_parser(), services["bootstrap"]["command"])
    for name in ("peer1", "peer2", "peer3"):
        argv = [a.replace("${BOOTSTRAP_ID:?run the bootstrap first, see the top of this file}", "12D3KooWAbc")
                for a in services[name]["command"]]  # fmt: skip
        args = peer_parser().parse_args(argv)
        assert args.config == "/config/peer.toml" and args.resume == "auto"
        assert any(v.endswith(":/config/peer.toml:ro") for v in services[name]["volumes"])
    cfg = load_config(DOCKER / "peer.toml", {})
    assert cfg.model.stages == 2 and cfg.run.run_id == "compose-demo"
