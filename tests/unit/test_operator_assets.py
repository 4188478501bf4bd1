"""Operator assets (peer/, bootstrap/) stay runnable and say only what the code does.

- every peer/*.toml loads and passes the config checks, and `(local)` marks exactly the local fields;
- the shell scripts pass `bash -n`; the commands launch.sh and torchrun.sh would run (DILOCOX_DRY_RUN=1)
  parse with the real parsers and build valid configs, with --resume exactly when checkpoints exist;
- the systemd units stop cleanly (KillMode=mixed, SIGTERM, a long enough timeout) and restart; the peer
  unit's example environment runs through launch.sh, and the bootstrap unit's ExecStart, expanded with
  bootstrap.env as systemd does, parses with dilocox-bootstrap's parser;
- the Grafana dashboard's PromQL and the guides name only metrics and labels that StatusCollector
  (and the bootstrap node) export;
- every dilocox-peer / dilocox-bootstrap command line in the guides parses, every --flag they mention
  exists, and every DILOCOX_* variable they mention is one the scripts read.

Run: python -m pytest tests/unit/test_operator_assets.py -q
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from dilocox_p2p import bootstrap
from dilocox_p2p.cli.bootstrap import build_parser as bootstrap_parser
from dilocox_p2p.cli.__main__ import build_parser
from dilocox_p2p.cli.options import config_from_args
from dilocox_p2p.config import SwarmConfig, config_hash, load_config, shared_fields

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PEER, BOOT = ROOT / "peer", ROOT / "bootstrap"
OUR_TOMLS = ["one-gpu.toml", "node-8gpu.toml", "cluster-torchrun.toml"]
GUIDES = [PEER / "README.md", BOOT / "README.md"]
TEXT_ASSETS = [
    *GUIDES, PEER / "launch.sh", PEER / "torchrun.sh", PEER / "dilocox-peer.service", PEER / "prometheus.yml",
    BOOT / "dilocox-bootstrap.service", BOOT / "bootstrap.env", *(PEER / name for name in OUR_TOMLS),
]  # fmt: skip
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series
SAMPLE_PEER = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWMGFKJ93LvT92B3iBCZhDifGgHkUX1dUHne3fTFbtqmM7"


# ----- configs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(PEER.glob("*.toml")), ids=lambda p: p.name)
def test_every_peer_config_loads_and_passes_its_checks(path):
    cfg = load_config(path, {})
    assert len(config_hash(cfg)) == 64


@pytest.mark.parametrize("name", OUR_TOMLS)
def test_local_marks_name_exactly_the_fields_that_may_differ_between_peers(name):
    cfg = load_config(PEER / name, {})
    shared = shared_fields(cfg)
    section, wrong = "", []
    for line in (PEER / name).read_text().splitlines():
        if m := re.match(r"^\[(\w+)\]", line):
            section = m.group(1)
        elif m := re.match(r"^(\w+)\s*=", line):
            marked, is_local = "(local)" in line, m.group(1) not in shared[section]
            if marked != is_local:
                wrong.append(f"{section}.{m.group(1)}: marked {'local' if marked else 'shared'}, is the other")
    assert not wrong, wrong


def test_the_8gpu_node_and_the_torchrun_cluster_describe_one_run():
    node, cluster = (load_config(PEER / n, {}) for n in ("node-8gpu.toml", "cluster-torchrun.toml"))
    assert config_hash(node) == config_hash(cluster)
    assert node.model.stages == 4 and node.run.device == "cuda"


# ----- scripts --------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", sorted(PEER.glob("*.sh")), ids=lambda p: p.name)
def test_shell_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _dry_run(script: Path, env: dict[str, str]) -> list[list[str]]:
    """The command lines `script` would run, from DILOCOX_DRY_RUN=1 (printed shell-quoted, one per line)."""
    full = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env, "DILOCOX_DRY_RUN": "1"}
    result = subprocess.run(["bash", str(script)], env=full, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]


def _peer_args(argv: list[str]) -> argparse.Namespace:
    """Parse a dilocox-peer command line (no program name) and, for join/doctor, build its config."""
    args = build_parser().parse_args(argv)
    if args.command in ("join", "doctor") and (args.config is None or (ROOT / args.config).exists()):
        cwd = os.getcwd()
        os.chdir(ROOT)  # config paths in the assets are relative to the repository root
        try:
            config_from_args(args)
        finally:
            os.chdir(cwd)
    return args


def _launch_env(run_dir: Path) -> dict[str, str]:
    return {
        "DILOCOX_CONFIG": "peer/one-gpu.toml", "DILOCOX_RUN_DIR": str(run_dir),
        "DILOCOX_INITIAL_PEERS": f"{SAMPLE_PEER} {SAMPLE_PEER.replace('203.0.113.7', '198.51.100.2')}",
        "DILOCOX_ANNOUNCE_MADDRS": "/ip4/198.51.100.20/tcp/31400", "DILOCOX_AUTO_RELAY": "1",
        "DILOCOX_EXTRA_ARGS": "--control-addr 127.0.0.1:7101 --log-level debug",
    }  # fmt: skip


def test_launch_runs_doctor_with_the_join_flags_then_joins_with_resume_auto(tmp_path):
    env = _launch_env(tmp_path / "run dir")
    doctor, join = _dry_run(PEER / "launch.sh", env)
    assert doctor[:2] == ["dilocox-peer", "doctor"] and join[:2] == ["dilocox-peer", "join"]
    assert doctor[2:] == join[2:-2] and join[-2:] == ["--resume", "auto"]  # doctor checks what join will use
    args = _peer_args(join[1:])
    assert args.resume == "auto" and args.run_dir == env["DILOCOX_RUN_DIR"] and args.auto_relay
    assert len(args.initial_peers) == 2 and args.control_addr == "127.0.0.1:7101"
    _peer_args(doctor[1:])
    assert [c[1] for c in _dry_run(PEER / "launch.sh", {**env, "DILOCOX_DOCTOR": "off"})] == ["join"]


def _fake_peer(tmp_path: Path, doctor_exit: int) -> Path:
    """A stand-in dilocox-peer whose doctor exits `doctor_exit` and whose join says it ran."""
    fake = tmp_path / "fake-dilocox-peer"
    fake.write_text(f'#!/usr/bin/env bash\n[[ $1 == doctor ]] && exit {doctor_exit}\necho "ran $1"\n')
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize(("policy", "checkpoints", "doctor_exit", "joins"), [
    ("auto", False, 0, True), ("auto", False, 1, False), ("auto", True, 1, True),
    ("strict", True, 1, False), ("off", False, 1, True),
])  # fmt: skip
def test_a_failed_doctor_blocks_a_first_start_but_not_a_resume(tmp_path, policy, checkpoints, doctor_exit, joins):
    run_dir = tmp_path / "run"
    stage = run_dir / "checkpoints" / "stage0"
    stage.mkdir(parents=True)
    (stage / ".round000001.pt.tmp").write_bytes(b"")  # a torn write is no checkpoint
    if checkpoints:
        (stage / "round000001.pt").write_bytes(b"")
    env = {**_launch_env(run_dir), "DILOCOX_BIN": str(_fake_peer(tmp_path, doctor_exit)), "DILOCOX_DOCTOR": policy}
    result = subprocess.run(["bash", str(PEER / "launch.sh")], env={"PATH": os.environ["PATH"], **env},
                            cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (result.stdout == "ran join\n") == joins, result.stderr
    assert (result.returncode == 0) == joins


def test_torchrun_script_runs_one_stage_per_process_through_launch(tmp_path):
    from torch.distributed.run import get_args_parser

    env = {"NNODES": "2", "NPROC_PER_NODE": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "DILOCOX_CONFIG": "peer/cluster-torchrun.toml", "DILOCOX_RUN_DIR": str(tmp_path),
           "DILOCOX_IDENTITY": str(tmp_path / "peer.pem")}  # fmt: skip
    doctor, torchrun = _dry_run(PEER / "torchrun.sh", env)
    _peer_args(doctor[1:])
    assert torchrun[0] == "torchrun"
    launcher = get_args_parser().parse_args(torchrun[1:])
    assert (launcher.module, launcher.training_script) == (True, "dilocox_p2p.cli")
    assert launcher.node_rank == 1 and launcher.master_addr == "10.0.0.1" and launcher.rdzv_backend == "static"
    args = _peer_args(launcher.training_script_args)
    assert args.command == "join" and args.identity == env["DILOCOX_IDENTITY"]
    stages = load_config(ROOT / args.config, {}).model.stages
    assert int(launcher.nnodes) * int(launcher.nproc_per_node) == stages


# ----- systemd units --------------------------------------------------------------------------------
def _unit(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _env_file(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile reads them (comments skipped, one pair of quotes removed)."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line and line[0] not in "#;" and "=" in line:
            key, _, value = line.partition("=")
            value = value.strip()
            env[key.strip()] = value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "\"'" else value
    return env


UNITS = [PEER / "dilocox-peer.service", BOOT / "dilocox-bootstrap.service"]


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_units_stop_cleanly_and_restart_as_a_dedicated_user(path):
    service = _unit(path)["Service"]
    one = {key: values[-1] for key, values in service.items()}
    assert one["KillMode"] == "mixed"  # SIGTERM to the launcher only: it forwards one to each stage
    assert one["KillSignal"] == "SIGTERM" and one["Restart"] == "on-failure"
    assert one["User"] not in ("", "root") and one["StateDirectory"]
    if path.name == "dilocox-peer.service":  # a stage may wait out a round's group and all-reduce first
        defaults = SwarmConfig()
        assert int(one["TimeoutStopSec"]) > defaults.round_wait + defaults.allreduce_timeout
        assert "143" in one["SuccessExitStatus"].split()  # 128 + SIGTERM: a clean stop
        assert one["ExecStart"] == "/opt/dilocox/peer/launch.sh"


def test_the_peer_units_example_environment_runs_through_launch(tmp_path):
    text = (PEER / "dilocox-peer.service").read_text()
    env = _env_file("\n".join(_unit(PEER / "dilocox-peer.service")["Service"]["Environment"]))
    example = text.split("peer.env example", 1)[1].split("\n\n", 1)[0]
    env.update(_env_file("\n".join(line.lstrip("#").strip() for line in example.splitlines()[1:])))
    assert env["DILOCOX_CONFIG"] == "/etc/dilocox/peer.toml" and "DILOCOX_INITIAL_PEERS" in env
    env.update(DILOCOX_CONFIG="peer/one-gpu.toml", DILOCOX_RUN_DIR=str(tmp_path))  # installed from one-gpu.toml
    env.pop("PATH")
    doctor, join = _dry_run(PEER / "launch.sh", env)
    args = _peer_args(join[1:])
    assert args.initial_peers == env["DILOCOX_INITIAL_PEERS"].split()
    assert args.announce_maddrs == env["DILOCOX_ANNOUNCE_MADDRS"].split()


def _systemd_expand(command: str, env: dict[str, str]) -> list[str]:
    """ExecStart words: $VAR becomes its value split on whitespace (nothing when empty), ${VAR} one word."""
    out: list[str] = []
    for word in shlex.split(command):
        if m := re.fullmatch(r"\$(\w+)", word):
            out += env.get(m.group(1), "").split()
        else:
            out.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return out


def test_the_bootstrap_units_command_with_its_env_file_parses():
    from dilocox_p2p.doctor import listen_hostport, parse_peer_maddr

    service = _unit(BOOT / "dilocox-bootstrap.service")["Service"]
    assert service["EnvironmentFile"] == ["/etc/dilocox/bootstrap.env"]
    env = _env_file((BOOT / "bootstrap.env").read_text())
    argv = _systemd_expand(service["ExecStart"][0], env)
    assert argv[0].endswith("/dilocox-bootstrap")
    args = bootstrap_parser().parse_args(argv[1:])
    assert str(args.state_dir) == f"/var/lib/{service['StateDirectory'][0]}"
    assert args.relay and args.announce_maddrs
    for maddr in (*args.host_maddrs, *args.announce_maddrs):
        assert listen_hostport(maddr) is not None, f"{maddr}: a fixed TCP port keeps the address stable"
    for maddr in args.initial_peers:
        parse_peer_maddr(maddr)
    assert args.host_maddrs[0].endswith("/tcp/31337") and args.announce_maddrs[0].endswith("/tcp/31337")


# ----- metrics ----------------------------------------------------------------------------------------
def _exposition(registry) -> dict[str, set[str]]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


@pytest.fixture(scope="module")
def peer_series() -> dict[str, set[str]]:
    """Sample name -> label names, as a peer's /metrics shows them after a compressed round with faults."""
    from prometheus_client import CollectorRegistry

    from dilocox_p2p.control import StatusBoard, StatusCollector

    board = StatusBoard(load_config(None, {}), rounds=10, steps=5)
    board.identify(peer_id="12D3KooWMGFKJ93LvT92B3iBCZhDifGgHkUX1dUHne3fTFbtqmM7", peer_key="ab" * 32)
    board.set_state("training")
    record = {
        "round": 0, "train_loss": 3.0, "val_loss": 3.1, "tokens": 100, "tokens_per_s": 10.0, "bytes_sent": 50,
        "bytes_received": 50, "seconds_comm_wait": 0.1, "stage_hashes": ["a" * 64, "b" * 64], "group_sizes": [2, 2],
        "group_size": 2, "kinds": ["averaged", "averaged"], "fp32_bytes": [400, 400], "faults": {"repairs": 1},
        "counted_shares": [1.0, 0.5],
    }  # fmt: skip
    board.round_done(record, members=[["a", "b"], ["a", "b"]])
    registry = CollectorRegistry()
    registry.register(StatusCollector(board))
    return _exposition(registry)


@pytest.fixture(scope="module")
def bootstrap_series() -> dict[str, set[str]]:
    return _exposition(bootstrap._Metrics.create(time.time()).registry)


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}")


def promql_problems(expr: str, series: dict[str, set[str]], legend: str = "") -> list[str]:
    """Metric and label names in `expr` (and `{{label}}` in `legend`) that `series` does not export."""
    problems, used = [], set()
    all_labels = set().union(*series.values()) | TARGET_LABELS
    text = _STRING.sub('""', expr)
    for labels in _LABEL_LIST.findall(text):
        problems += [f"grouping label {n!r}" for n in re.findall(r"\w+", labels) if n not in all_labels]
    text = _LABEL_LIST.sub(" ", text)
    for metric, matchers in _SELECTOR.findall(text):
        names = [m.group(1) for item in matchers.split(",") if (m := re.match(r"\s*([a-zA-Z_]\w*)", item))]
        known = series.get(metric, all_labels) | TARGET_LABELS
        problems += [f"label {n!r} of {metric or 'a selector'}" for n in names if n not in known]
        used.add(metric)
    text = _SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    used |= {w for w in re.findall(r"\b[a-zA-Z_:][\w:]*\b", text) if w.startswith("dilocox_")}
    problems += [f"metric {m!r}" for m in sorted(used) if m and m.startswith("dilocox_") and m not in series]
    legend_labels = set().union(*(series.get(m, set()) for m in used)) | TARGET_LABELS
    problems += [f"legend label {n!r}" for n in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend) if n not in legend_labels]
    return problems


def test_the_promql_checker_catches_unknown_metrics_and_labels(peer_series):
    good = 'sum by (instance, kind) (increase(dilocox_faults_total{kind="repairs"}[1h]))'
    assert not promql_problems(good, peer_series)
    assert promql_problems("dilocox_val_loss_total", peer_series) == ["metric 'dilocox_val_loss_total'"]
    assert promql_problems('dilocox_group_size{peer="x"}', peer_series) == ["label 'peer' of dilocox_group_size"]
    assert promql_problems("max by (stagee) (dilocox_group_size)", peer_series) == ["grouping label 'stagee'"]
    assert promql_problems("dilocox_round", peer_series, "{{stage}}") == ["legend label 'stage'"]


def _dashboard() -> dict:
    return json.loads((PEER / "grafana-dashboard.json").read_text())


def test_grafana_dashboard_queries_only_what_a_peer_exports(peer_series):
    dash = _dashboard()
    problems = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            problems += [f"{panel['title']}: {p}" for p in
                         promql_problems(target["expr"], peer_series, target.get("legendFormat", ""))]  # fmt: skip
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", var["definition"])
            assert m, var["definition"]
            found = promql_problems(m.group(1), peer_series, "{{%s}}" % m.group(2))
            problems += [f"${var['name']}: {p}" for p in found]
    assert not problems, problems
    exported = {name for name in peer_series if name.startswith("dilocox_")}
    shown = {m for p in dash["panels"] for t in p.get("targets", []) for m in re.findall(r"dilocox_\w+", t["expr"])}
    assert exported - shown - {"dilocox_stages"} == set(), "every exported figure has a panel"


def test_grafana_dashboard_is_importable_with_a_prometheus_datasource_variable():
    dash = _dashboard()
    (ds,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    ref = {"type": "prometheus", "uid": "${%s}" % ds["name"]}
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert panels and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in panels:
        assert panel["datasource"] == ref and panel["targets"], panel["title"]
        assert all(t["datasource"] == ref and t["expr"] for t in panel["targets"]), panel["title"]
        assert set(panel["gridPos"]) == {"x", "y", "w", "h"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text.replace("\\|", "|"))


def test_guides_and_scrape_config_name_only_exported_metrics(peer_series, bootstrap_series):
    problems = []
    for path in TEXT_ASSETS:
        text = path.read_text()
        for name in sorted(set(re.findall(r"\bdilocox_[a-z0-9_]+", text))):
            if name.startswith("dilocox_p2p"):
                continue  # the package
            series = bootstrap_series if name.startswith("dilocox_bootstrap") else peer_series
            known = set(series) | set().union(*series.values())
            if name not in known and not any(s.startswith(name) for s in series):  # "dilocox_bootstrap_" prefixes
                problems.append(f"{path.name}: {name}")
        for code in _backticked(text):  # PromQL in the guides' tables: metric{labels} and alert expressions
            if re.search(r"dilocox_\w+\s*\{|\(.*dilocox_", code) and not code.startswith("dilocox_bootstrap"):
                problems += [f"{path.name}: `{code}`: {p}" for p in promql_problems(code, peer_series)]
    assert not problems, problems


# ----- guides: commands, flags, variables --------------------------------------------------------------
def _command_lines(text: str) -> list[tuple[list[str], bool]]:
    """dilocox-peer / dilocox-bootstrap command lines in the guide `text`, as (words, whether it is in a code
    block: those must run as they are; inline ones may hold placeholders such as MADDR)."""
    lines = []
    for block in re.findall(r"```(?:bash)?\n(.*?)```", text, flags=re.S):
        lines += [(line, True) for line in block.replace("\\\n", " ").splitlines()]
    lines += [(code, False) for code in _backticked(text)]
    commands = []
    for line, runnable in lines:
        words = shlex.split(line, comments=True) if line.strip() else []
        while words and (re.fullmatch(r"[A-Z_]+=.*", words[0]) or words[0] == "sudo" or words[:2] == ["-u", "dilocox"]):
            words = words[2:] if words[0] == "-u" else words[1:]
        if words and re.fullmatch(r"(.*/bin/)?dilocox-(peer|bootstrap)", words[0]):
            end = next((i for i, w in enumerate(words) if w in ("|", "&", "&&", ";", ">")), len(words))
            commands.append(([Path(words[0]).name] + [w for w in words[1:end] if w != "..."], runnable))
    return commands


def test_every_command_line_in_the_guides_parses():
    commands = [c for guide in GUIDES for c in _command_lines(guide.read_text())]
    assert len(commands) > 10
    for words, runnable in commands:
        try:
            if words[0] == "dilocox-peer":
                _peer_args(words[1:]) if runnable else build_parser().parse_args(words[1:])
            else:
                bootstrap_parser().parse_args(words[1:])
        except SystemExit as e:  # --version exits 0; a usage error exits 2
            assert e.code == 0, shlex.join(words)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found |= {s for s in action.option_strings if s.startswith("--")}
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


def test_every_flag_the_assets_mention_exists():
    from torch.distributed.run import get_args_parser

    known = _option_strings(build_parser()) | _option_strings(get_args_parser())
    try:
        from dilocox_p2p.cli.bootstrap import build_parser as bootstrap_parser
    except ImportError:
        bootstrap_parser = None
    if bootstrap_parser is not None:
        known |= _option_strings(bootstrap_parser())
    system_tools = {"--now", "--system", "--home-dir", "--shell", "--config.file"}  # systemctl, useradd, prometheus
    unknown = set()
    for path in TEXT_ASSETS:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9.-]*[a-z0-9]", path.read_text()):
            if flag not in known | system_tools and not (bootstrap_parser is None and path.parent == BOOT):
                unknown.add(f"{path.name}: {flag}")
    assert not unknown, sorted(unknown)


def test_every_dilocox_variable_mentioned_is_one_the_scripts_read():
    scripts = (PEER / "launch.sh").read_text() + (PEER / "torchrun.sh").read_text()
    read = set(re.findall(r"\$\{?(DILOCOX_\w+)", scripts)) | {"DILOCOX_LOGLEVEL"}  # logs.py reads the last
    mentioned = {(p.name, v) for p in TEXT_ASSETS for v in re.findall(r"\bDILOCOX_[A-Z_]+\b", p.read_text())}
    assert not {(name, v) for name, v in mentioned if v not in read}
