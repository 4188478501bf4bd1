"""CLI: `config show`, flags over files, one-line errors with exit code 2, a subprocess smoke test.

Most tests call `dilocox_p2p.cli.__main__.main(argv)` in-process; the last two run
`python -m dilocox_p2p.cli` as a real subprocess.

Run: python -m pytest tests/unit/test_cli.py -q
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from dilocox_p2p import __version__
from dilocox_p2p.cli.__main__ import main
from dilocox_p2p.config import config_hash, load_config

pytestmark = pytest.mark.unit


def _run(argv: list[str]) -> int:
    """main(argv)'s exit code, whether it returns it or argparse raises SystemExit."""
    try:
        return main(argv)
    except SystemExit as e:
        return 0 if e.code is None else int(e.code) if isinstance(e.code, int) else 1


def _show(capsys, *argv: str):
    code = _run(["config", "show", *argv])
    out = capsys.readouterr().out
    assert code == 0
    return out


def _one_line_error(capsys, argv: list[str]) -> str:
    code = _run(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert "Traceback" not in captured.err
    assert len(lines) == 1, captured.err
    return lines[0]


# ----- config show -----------------------------------------------------------------------


def test_config_show_prints_toml_that_load_config_accepts_and_its_hash(capsys, tmp_path):
    out = _show(capsys)
    first = out.splitlines()[0]
    match = re.fullmatch(r"# config hash ([0-9a-f]{64}) .*", first)
    assert match, first
    path = tmp_path / "shown.toml"
    path.write_text(out)
    cfg = load_config(path)
    assert config_hash(cfg) == match.group(1)
    assert cfg == load_config()


def test_config_show_applies_flags(capsys, tmp_path):
    out = _show(capsys, "--preset", "small", "--stages", "4", "--inner-lr", "3e-4", "--mode", "sync",
                "--data", "a.txt", "b/", "--set", "inner.warmup_steps=7")
    cfg = tomllib.loads(out)
    assert cfg["model"]["preset"] == "small"
    assert cfg["model"]["stages"] == 4
    assert cfg["inner"]["lr"] == pytest.approx(3e-4)
    assert cfg["inner"]["warmup_steps"] == 7
    assert cfg["outer"]["mode"] == "sync"
    assert cfg["data"]["paths"] == ["a.txt", "b/"]


def test_flags_override_the_config_file_and_the_file_overrides_defaults(capsys, tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text('[inner]\nsteps = 7\nbatch_size = 8\n[model]\nstages = 1\n[run]\nrun_id = "fromfile"\n')
    cfg = tomllib.loads(_show(capsys, "--config", str(path), "--inner-steps", "9", "--set", "run.run_id=fromflag"))
    assert cfg["inner"]["steps"] == 9
    assert cfg["inner"]["batch_size"] == 8
    assert cfg["model"]["stages"] == 1
    assert cfg["run"]["run_id"] == "fromflag"


def test_a_named_flag_wins_over_set_for_the_same_field(capsys):
    cfg = tomllib.loads(_show(capsys, "--set", "inner.steps=3", "--inner-steps", "4"))
    assert cfg["inner"]["steps"] == 4


# ----- user errors: one line on stderr, exit code 2 --------------------------------------


def test_a_missing_config_file_is_one_line_naming_it(capsys, tmp_path):
    missing = tmp_path / "missing.toml"
    line = _one_line_error(capsys, ["config", "show", "--config", str(missing)])
    assert str(missing) in line and "does not exist" in line


def test_invalid_toml_is_one_line_naming_the_file(capsys, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[inner\nsteps = = 3\n")
    line = _one_line_error(capsys, ["config", "show", "--config", str(path)])
    assert str(path) in line and "not valid TOML" in line


def test_an_unknown_preset_is_one_line_listing_the_presets(capsys):
    line = _one_line_error(capsys, ["config", "show", "--preset", "huge"])
    assert "model.preset" in line and "'huge'" in line and "tiny" in line


def test_more_stages_than_layers_is_one_line_naming_the_layer_count(capsys):
    line = _one_line_error(capsys, ["config", "show", "--preset", "tiny", "--stages", "9"])
    assert "model.stages = 9" in line and "only 4 layers" in line


def test_negative_inner_steps_is_one_line(capsys):
    line = _one_line_error(capsys, ["config", "show", "--inner-steps", "-5"])
    assert "inner.steps = -5" in line


def test_an_unknown_flag_is_one_line(capsys):
    line = _one_line_error(capsys, ["config", "show", "--no-such-flag"])
    assert "--no-such-flag" in line


def test_a_non_integer_for_an_integer_flag_is_one_line(capsys):
    line = _one_line_error(capsys, ["config", "show", "--stages", "two"])
    assert "--stages" in line and "'two'" in line


def test_set_with_an_unknown_section_is_one_line(capsys):
    line = _one_line_error(capsys, ["config", "show", "--set", "nosuchsection.x=1"])
    assert "nosuchsection" in line


def test_set_with_an_unknown_key_is_one_line(capsys):
    line = _one_line_error(capsys, ["config", "show", "--set", "inner.nosuchkey=1"])
    assert "inner.nosuchkey" in line


def test_set_without_a_value_is_one_line(capsys):
    line = _one_line_error(capsys, ["config", "show", "--set", "inner.steps"])
    assert "section.key=value" in line


def test_no_command_is_one_line(capsys):
    line = _one_line_error(capsys, [])
    assert "COMMAND" in line or "required" in line


def test_version_prints_the_package_version(capsys):
    assert _run(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dilocox-p2p {__version__}"


# ----- real subprocess -------------------------------------------------------------------


def test_python_dash_m_config_show_runs_as_a_subprocess(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dilocox_p2p.cli", "config", "show", "--preset", "small"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cfg = tomllib.loads(proc.stdout)
    assert cfg["model"]["preset"] == "small"


def test_python_dash_m_version_runs_as_a_subprocess(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dilocox_p2p.cli", "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"dilocox-p2p {__version__}"


# ----- identities and closed runs ------------------------------------------------------------------
def test_keygen_writes_a_private_key_only_its_owner_can_read_and_never_overwrites_it(capsys, tmp_path):
    key = tmp_path / "peer.pem"
    assert _run(["keygen", "--out", str(key)]) == 0
    public = capsys.readouterr().out.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", public), public
    assert key.stat().st_mode & 0o777 == 0o600
    before = key.read_bytes()
    assert _run(["keygen", "--out", str(key)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert key.read_bytes() == before


def test_join_refuses_a_worker_key_others_can_read_before_any_stage_starts(capsys, tmp_path):
    from dilocox_p2p.identity import worker_identity

    key = tmp_path / "run" / "identity" / "stage1.ed25519"  # kept from an earlier start of this run dir
    worker_identity(key)
    key.chmod(0o644)
    code = _run(["join", "--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--stages", "2"])
    err = capsys.readouterr().err
    assert code == 2 and f"worker key {key} is readable by others" in err and f"chmod 600 {key}" in err, err
    assert not (tmp_path / "run" / "identity" / "stage0.ed25519").exists()  # refused before stage 0's key was made


def test_join_refuses_an_identity_others_can_read_and_says_how_to_fix_it(capsys, tmp_path):
    key = tmp_path / "peer.pem"
    assert _run(["keygen", "--out", str(key)]) == 0
    key.chmod(0o644)
    capsys.readouterr()
    code = _run(["join", "--run-dir", str(tmp_path / "run"), "--identity", str(key), "--preset", "tiny"])
    err = capsys.readouterr().err
    assert code == 2 and "readable by others" in err and f"chmod 600 {key}" in err, err


def test_join_without_a_certificate_is_refused_by_a_closed_run_before_any_stage_starts(capsys, tmp_path):
    assert _run(["keygen", "--out", str(tmp_path / "run.pem")]) == 0
    run_key = capsys.readouterr().out.strip()
    code = _run([
        "join", "--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--set", "swarm.admission=closed",
        "--set", f"swarm.run_key={run_key}",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "this closed run does not admit this peer" in err and "dilocox-peer certify" in err, err
    assert not (tmp_path / "run" / "logs").exists(), "a stage started"


def test_certify_admits_exactly_the_key_it_names_to_the_run_it_names(capsys, tmp_path):
    from dilocox_p2p.envelope import Policy
    from dilocox_p2p.identity import load_run_certificate, verify_run_certificate

    assert _run(["keygen", "--out", str(tmp_path / "run.pem")]) == 0
    run_key = bytes.fromhex(capsys.readouterr().out.strip())
    assert _run(["keygen", "--out", str(tmp_path / "peer.pem")]) == 0
    peer_key = capsys.readouterr().out.strip()
    cert_path = tmp_path / "peer.cert"
    assert _run(["certify", "--run-key", str(tmp_path / "run.pem"), "--run-id", "r1", "--peer-key", peer_key,
                 "--out", str(cert_path), "--note", "lab A"]) == 0  # fmt: skip
    cert = load_run_certificate(cert_path)
    assert cert.peer_key.hex() == peer_key and cert.run_id == "r1" and cert.note == "lab A"
    assert verify_run_certificate(cert, run_key)
    assert not verify_run_certificate(cert, bytes(32))
    assert Policy(run_id="r1", closed=True, run_key=run_key)  # a closed run with only a run key is valid
    assert _run(["certify", "--run-key", str(tmp_path / "run.pem"), "--run-id", "r1", "--peer-key", "zz",
                 "--out", str(tmp_path / "x.cert")]) == 2  # fmt: skip
    assert "is not hex" in capsys.readouterr().err
