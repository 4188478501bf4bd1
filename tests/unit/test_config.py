"""Config: defaults, TOML files, dotted overrides, validation messages, hashing.

Run: python -m pytest tests/unit/test_config.py -q
"""

from __future__ import annotations

import dataclasses

import pytest

from dilocox_p2p.config import (
    PRESETS,
    Config,
    OuterConfig,
    config_hash,
    load_config,
    parse_override,
    to_toml,
)
from dilocox_p2p.errors import ConfigError

pytestmark = pytest.mark.unit


def _write(tmp_path, text: str):
    path = tmp_path / "peer.toml"
    path.write_text(text)
    return path


# ----- loading ---------------------------------------------------------------------------


def test_defaults_load_without_a_file_and_equal_the_dataclass_defaults():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.preset == "tiny"
    # sync at 1.0 / 0.7: the only mode within 2% of sync fp32 on the quality lab's long horizon (docs/benchmarks.md,
    # section 7: join's defaults on the long horizon)
    assert cfg.outer.mode == "sync" and cfg.outer.effective_lr == 1.0 and cfg.outer.effective_momentum == 0.7
    assert cfg.outer.fragments == 1 and cfg.outer.overlap_steps == 5  # streaming's, resolved in every mode
    # int8: the same loss as fp32 at 3.9x fewer bytes (docs/benchmarks.md, section 1: join's defaults)
    assert cfg.compression.kind == "int8"
    assert cfg.model.shape == PRESETS["tiny"]


def test_toml_file_sets_the_fields_it_names_and_keeps_defaults_for_the_rest(tmp_path):
    path = _write(
        tmp_path,
        """
        [model]
        preset = "small"
        stages = 4

        [inner]
        steps = 25
        lr = 3e-4

        [data]
        paths = ["a.txt", "b/"]
        """,
    )
    cfg = load_config(path)
    assert cfg.model.preset == "small"
    assert cfg.model.stages == 4
    assert cfg.inner.steps == 25
    assert cfg.inner.lr == pytest.approx(3e-4)
    assert cfg.data.paths == ("a.txt", "b/")
    assert cfg.inner.batch_size == Config().inner.batch_size
    assert cfg.outer == Config().outer


def test_dotted_overrides_win_over_the_file(tmp_path):
    path = _write(tmp_path, "[inner]\nsteps = 25\n[model]\nstages = 1\n")
    cfg = load_config(path, overrides={"inner.steps": 50, "model.stages": 4, "outer.mode": "sync"})
    assert cfg.inner.steps == 50
    assert cfg.model.stages == 4
    assert cfg.outer.mode == "sync"


def test_an_int_is_accepted_where_a_float_is_expected():
    cfg = load_config(overrides={"inner.lr": 1})
    assert cfg.inner.lr == 1.0
    assert isinstance(cfg.inner.lr, float)


def test_a_single_string_is_accepted_for_a_list_of_paths():
    assert load_config(overrides={"data.paths": "corpus/"}).data.paths == ("corpus/",)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("inner.lr=3e-4", ("inner.lr", 3e-4)),
        ("inner.steps=50", ("inner.steps", 50)),
        ("outer.mode=sync", ("outer.mode", "sync")),
        ('run.run_id="quoted"', ("run.run_id", "quoted")),
        ("run.run_id=bare-word", ("run.run_id", "bare-word")),
        ('data.paths=["a", "b"]', ("data.paths", ["a", "b"])),
        ("swarm.min_group_size = 3", ("swarm.min_group_size", 3)),
    ],
)
def test_parse_override_reads_toml_values_and_bare_words_as_strings(text, expected):
    key, value = parse_override(text)
    assert (key, value) == expected
    assert type(value) is type(expected[1])


@pytest.mark.parametrize("text", ["inner.lr", "lr=3e-4", ""])
def test_parse_override_without_section_key_and_value_is_a_config_error(text):
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override(text)


def test_parsed_overrides_feed_load_config():
    cfg = load_config(overrides=dict(parse_override(t) for t in ["inner.lr=3e-4", "outer.mode=sync"]))
    assert cfg.inner.lr == pytest.approx(3e-4)
    assert cfg.outer.mode == "sync"


# ----- errors ----------------------------------------------------------------------------


def test_unknown_section_in_file_is_named(tmp_path):
    path = _write(tmp_path, "[trainer]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section \[trainer\]"):
        load_config(path)


def test_unknown_section_in_override_is_named():
    with pytest.raises(ConfigError, match=r"unknown section \[nosuchsection\]"):
        load_config(overrides={"nosuchsection.x": 1})


def test_unknown_key_is_named_with_the_known_keys(tmp_path):
    path = _write(tmp_path, "[inner]\nstep = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key inner\.step\b.*steps"):
        load_config(path)


@pytest.mark.parametrize(
    ("key", "value", "type_name"),
    [
        ("inner.steps", "10", "an integer"),
        ("inner.steps", True, "an integer"),
        ("inner.steps", 2.5, "an integer"),
        ("inner.lr", "fast", "a number"),
        ("inner.lr", False, "a number"),
        ("run.run_id", 7, "a string"),
    ],
)
def test_wrong_type_names_the_key_and_the_expected_type(key, value, type_name):
    with pytest.raises(ConfigError, match=rf"{key}.*must be {type_name}"):
        load_config(overrides={key: value})


def test_list_field_rejects_non_strings():
    with pytest.raises(ConfigError, match=r"data\.paths.*list of strings"):
        load_config(overrides={"data.paths": [1, 2]})


def test_more_stages_than_layers_names_the_presets_layer_count():
    n_layer = PRESETS["tiny"].n_layer
    with pytest.raises(ConfigError, match=rf"model\.stages = {n_layer + 1}.*'tiny' has only {n_layer} layers"):
        load_config(overrides={"model.preset": "tiny", "model.stages": n_layer + 1})


def test_as_many_stages_as_layers_is_allowed():
    assert load_config(overrides={"model.stages": PRESETS["tiny"].n_layer}).model.stages == 4


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"inner.steps": -5}, r"inner\.steps = -5: must be at least 1"),
        ({"inner.steps": 0}, r"inner\.steps = 0"),
        ({"model.stages": 0}, r"model\.stages = 0"),
        ({"inner.batch_size": 10, "inner.microbatches": 4}, r"inner\.microbatches = 4: must divide inner\.batch_size \(10\)"),
        ({"model.stages": 4, "inner.microbatches": 2, "inner.batch_size": 4},
         r"inner\.microbatches = 2: must be at least model\.stages \(4\)"),
        ({"model.preset": "huge"}, r"model\.preset = 'huge': unknown preset.*tiny, mini, small, 125m, 350m, 1b"),
        ({"outer.mode": "fast"}, r"outer\.mode = 'fast': must be one of: sync, delayed"),
        ({"inner.schedule": "zb"}, r"inner\.schedule = 'zb'"),
        ({"outer.momentum": 1.0}, r"outer\.momentum"),
        ({"outer.lr": -0.1}, r"outer\.lr"),
        ({"inner.lr": 0.0}, r"inner\.lr = 0\.0: must be positive"),
        ({"data.val_fraction": 0.5}, r"data\.val_fraction"),
        ({"data.seed": -2}, r"data\.seed"),
        ({"run.run_id": "a b"}, r"run\.run_id"),
        ({"run.rounds": 0}, r"run\.rounds"),
        ({"swarm.round_wait": 0.0}, r"swarm\.round_wait"),
        ({"swarm.helper_nice": 20}, r"swarm\.helper_nice = 20: must be -19\.\.19"),
        ({"swarm.helper_nice": -20}, r"swarm\.helper_nice = -20"),
        ({"swarm.settled_nice": -1}, r"swarm\.settled_nice = -1: must be 0\.\.19 \(nice levels; a peer can only lower itself\)"),
        ({"swarm.settled_nice": 20}, r"swarm\.settled_nice = 20"),
        ({"model.seq_len": 1}, r"model\.seq_len = 1: must be at least 2"),
        ({"compression.kind": "zip"}, r"compression\.kind = 'zip': must be one of: none, fp16, int8, fp4, lowrank, topk"),
        ({"compression.topk_density": 0.0}, r"compression\.topk_density"),
        ({"compression.rank": 100, "compression.rank_max": 50}, r"compression\.rank = 100: must satisfy 1 <= rank_min \(1\) <= rank <= rank_max \(50, 0: auto\)"),
        ({"compression.energy_target": 1.0}, r"compression\.energy_target"),
        ({"compression.factor_bits": 2}, r"compression\.factor_bits = 2: must be one of: 4, 8"),
        ({"compression.feedback_decay": 1.5}, r"compression\.feedback_decay"),
        ({"outer.momentum": -0.5}, r"outer\.momentum"),
    ],
)
def test_impossible_values_are_config_errors_naming_the_field(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(overrides=overrides)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config(overrides={"inner.steps": -1})


def test_missing_file_is_a_config_error_naming_the_path(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"{missing}.*does not exist"):
        load_config(missing)


def test_invalid_toml_is_a_config_error_naming_the_path(tmp_path):
    path = _write(tmp_path, "[inner\nsteps = \n")
    with pytest.raises(ConfigError, match=rf"{path} is not valid TOML"):
        load_config(path)


def test_a_key_outside_any_table_is_a_config_error(tmp_path):
    path = _write(tmp_path, "steps = 3\n")
    with pytest.raises(ConfigError, match=r"\[steps\]"):
        load_config(path)


# ----- TOML round trip -------------------------------------------------------------------


def test_to_toml_round_trips_the_defaults(tmp_path):
    cfg = Config()
    assert load_config(_write(tmp_path, to_toml(cfg))) == cfg


def test_to_toml_round_trips_a_non_default_config(tmp_path):
    cfg = load_config(
        overrides={
            "run.run_id": "r7",
            "run.device": "cpu",
            "model.preset": "small",
            "model.stages": 3,
            "model.seq_len": 256,
            "data.paths": ["x/*.txt", "y.md"],
            "data.seed": 11,
            "inner.lr": 3e-4,
            "inner.schedule": "gpipe",
            "outer.mode": "sync",
            "outer.lr": 0.5,
            "swarm.initial_peers": ["/ip4/127.0.0.1/tcp/31337/p2p/QmU6wrRksUr2FGX8Y1MN9zvdAcPxeV3EwZy5WbWMrr7vCj"],
            "control.progress": "off",
        }
    )
    back = load_config(_write(tmp_path, to_toml(cfg)))
    assert back == cfg
    assert config_hash(back) == config_hash(cfg)


# ----- hash ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"inner.lr": 2e-3},
        {"inner.steps": 99},
        {"model.preset": "small"},
        {"model.stages": 1},
        {"model.seq_len": 64},
        {"outer.mode": "streaming"},
        {"outer.momentum": 0.8},
        {"run.seed": 1},
        {"run.run_id": "other"},
        {"data.val_fraction": 0.1},
    ],
)
def test_config_hash_changes_when_a_shared_field_changes(overrides):
    assert config_hash(load_config(overrides=overrides)) != config_hash(Config())


@pytest.mark.parametrize(
    "overrides",
    [
        {"run.run_dir": "/somewhere/else"},
        {"run.device": "cpu"},
        {"run.checkpoint_every": 5},
        {"data.paths": ["mine.txt"]},
        {"data.seed": 42},
        {"swarm.initial_peers": ["/ip4/10.0.0.1/tcp/4000/p2p/12D3KooWSpiRHc9xcSMBXR43h459bMCz1qLE2ePVbivnFnhYU3hJ"]},
        {"swarm.host_maddrs": ["/ip4/0.0.0.0/tcp/4000"]},
        {"control.progress": "lines"},
        {"control.log_level": "debug"},
        {"inner.threads": 3},
        {"inner.precision": "bf16"},
        {"inner.compile": "on"},
        {"inner.checkpoint_activations": True},
        {"inner.microbatches": 8},
        {"inner.schedule": "gpipe"},
        {"swarm.helper_nice": 5},
        {"swarm.settled_nice": 0},
    ],
)
def test_config_hash_ignores_local_fields(overrides):
    assert config_hash(load_config(overrides=overrides)) == config_hash(Config())


def test_config_hash_is_a_stable_hex_digest():
    first, second = config_hash(Config()), config_hash(load_config())
    assert first == second
    assert len(first) == 64
    int(first, 16)


def test_outer_lr_defaults_depend_on_the_mode_and_an_explicit_lr_wins():
    assert OuterConfig(mode="sync").effective_lr == 1.0
    assert OuterConfig(mode="delayed").effective_lr == 0.1
    assert OuterConfig(mode="sync", lr=0.3).effective_lr == 0.3
    assert OuterConfig(mode="delayed", lr=0.3).effective_lr == 0.3


def test_config_hash_covers_the_effective_outer_lr_not_the_zero_placeholder():
    implicit = load_config(overrides={"outer.mode": "delayed", "outer.lr": 0.0})
    explicit = load_config(overrides={"outer.mode": "delayed", "outer.lr": 0.1})
    assert config_hash(implicit) == config_hash(explicit)
    assert config_hash(implicit) != config_hash(load_config(overrides={"outer.lr": 0.2}))


def test_config_hash_covers_the_effective_seq_len():
    implicit = load_config(overrides={"model.seq_len": 0})
    explicit = load_config(overrides={"model.seq_len": PRESETS["tiny"].seq_len})
    assert config_hash(implicit) == config_hash(explicit)


def test_config_sections_are_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.inner.steps = 3  # type: ignore[misc]


def test_a_section_built_in_code_rejects_a_value_outside_its_choices():
    with pytest.raises(ConfigError, match=r"outer\.mode = 'fast': must be one of: sync, delayed"):
        OuterConfig(mode="fast")


@pytest.mark.parametrize(
    ("maddr", "message"),
    [
        ("foo", "not a multiaddr"),
        ("/ip4/203.0.113.7/tcp/31337", "lacks the peer id"),
    ],
)
def test_an_initial_peer_must_be_a_whole_multiaddr(maddr, message):
    with pytest.raises(ConfigError, match=rf"swarm\.initial_peers = '{maddr}': {message}"):
        load_config(overrides={"swarm.initial_peers": [maddr]})


def test_the_example_peer_config_loads():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "peer" / "example.toml")
    assert cfg.model.preset == "small" and cfg.swarm.host_maddrs == ("/ip4/0.0.0.0/tcp/31337",)


def test_outer_momentum_defaults_per_mode_and_to_0_with_top_k_whose_error_feedback_replaces_it():
    assert load_config().outer.effective_momentum == 0.7  # sync
    assert load_config(overrides={"outer.mode": "streaming"}).outer.effective_momentum == 0.9
    assert load_config(overrides={"outer.mode": "delayed"}).outer.effective_momentum == 0.9
    topk = load_config(overrides={"compression.kind": "topk"})
    assert topk.outer.effective_momentum == 0.0 and topk.compression.effective_feedback_decay == 0.95
    assert topk.outer.effective_lr == 4.0  # sync; without momentum the step needs a larger lr
    streaming_topk = load_config(overrides={"compression.kind": "topk", "outer.mode": "streaming"})
    assert streaming_topk.outer.effective_lr == 4.0 and streaming_topk.outer.effective_momentum == 0.0
    assert load_config(overrides={"compression.kind": "topk", "outer.mode": "delayed"}).outer.effective_lr == 2.0
    assert load_config(overrides={"compression.kind": "topk", "outer.mode": "sync"}).outer.effective_lr == 4.0
    assert load_config(overrides={"compression.kind": "topk", "outer.lr": 0.2}).outer.effective_lr == 0.2
    assert load_config(overrides={"compression.kind": "topk", "outer.momentum": 0.5}).outer.effective_momentum == 0.5
    assert load_config(overrides={"compression.kind": "lowrank"}).compression.effective_feedback_decay == 1.0
    # the resolved momentum is part of what peers must share
    assert config_hash(load_config()) != config_hash(load_config(overrides={"compression.kind": "topk"}))


@pytest.mark.parametrize("clip", [0.5, 11.0, -1.0])
def test_a_clip_ratio_outside_one_to_the_screens_bar_is_refused_with_the_range(clip):
    with pytest.raises(ConfigError, match=r"swarm.clip_ratio = .*must be 0 \(off\) or within \[1, max_norm_ratio = 10.0\]"):
        load_config(overrides={"swarm.clip_ratio": clip})



def test_devices_name_one_gpu_per_stage_from_the_command_line_or_toml(tmp_path):
    from dilocox_p2p.cli.__main__ import build_parser
    from dilocox_p2p.cli.options import config_from_args

    args = build_parser().parse_args(["join", "--no-swarm", "--stages", "2", "--microbatches", "2",
                                      "--devices", "cuda:3", "cuda:1"])  # fmt: skip
    assert config_from_args(args).run.devices == ("cuda:3", "cuda:1")
    path = tmp_path / "gpus.toml"
    path.write_text('[run]\ndevices = ["cuda:0", "cuda:2"]\n[model]\nstages = 2\n')
    assert load_config(path).run.devices == ("cuda:0", "cuda:2")
    assert load_config(overrides={"model.stages": 2}).run.devices == ()  # stage s on cuda:s


@pytest.mark.parametrize("devices, stages, why", [
    (["cuda:0"], 2, "names 1 GPUs for 2 stage processes"),
    (["cuda:0", "cuda:0"], 2, "names a GPU twice"),
    (["gpu0", "cuda:1"], 2, "'gpu0' is not cuda:N"),
    (["cuda:1"], 1, None),
])  # fmt: skip
def test_devices_that_do_not_give_each_stage_its_own_gpu_are_refused_with_the_reason(devices, stages, why):
    overrides = {"run.devices": devices, "model.stages": stages, "inner.microbatches": stages}
    if why is None:
        assert load_config(overrides=overrides).run.devices == tuple(devices)
        return
    with pytest.raises(ConfigError, match=why):
        load_config(overrides=overrides)
    with pytest.raises(ConfigError, match="names GPUs but run.device is cpu"):
        load_config(overrides={"run.devices": ["cuda:0"], "model.stages": 1, "run.device": "cpu"})


def test_devices_on_a_machine_without_cuda_fail_at_start_naming_the_flag():
    import torch

    from dilocox_p2p.peer_layout import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU tier checks --devices there (tests/gpu)")
    assert resolve_device("auto", 1).type == "cpu"
    with pytest.raises(ConfigError, match="--devices: no CUDA device is visible"):
        resolve_device("auto", 0, ["cuda:0"])


@pytest.mark.parametrize("overrides, why", [
    ({"run.replicas": 0}, "run.replicas = 0: must be at least 1"),
    ({"run.replicas": 3, "inner.batch_size": 16, "inner.microbatches": 4}, "multiple of run.replicas x inner.microbatches"),
    ({"run.replicas": 2, "model.stages": 2, "run.devices": ["cuda:0", "cuda:1"]}, "names 2 GPUs for 4 stage processes"),
])  # fmt: skip
def test_replicas_that_cannot_share_the_batch_or_the_gpus_are_refused_with_the_reason(overrides, why):
    from dilocox_p2p.cli.__main__ import build_parser
    from dilocox_p2p.cli.options import config_from_args

    with pytest.raises(ConfigError, match=why):
        load_config(overrides=overrides)
    # a peer's replicas are its own business: peers of one run may differ in them
    two = load_config(overrides={"run.replicas": 2, "inner.batch_size": 16, "inner.microbatches": 4})
    assert config_hash(two) == config_hash(load_config(overrides={"inner.batch_size": 16, "inner.microbatches": 4}))
    args = build_parser().parse_args(["join", "--replicas", "2"])
    assert config_from_args(args).run.replicas == 2
