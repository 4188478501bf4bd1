"""Run configuration: frozen dataclasses, loaded from TOML, overridden by CLI flags.

One `Config` holds eight sections (run, model, data, inner, outer, compression, swarm,
control). Values are checked on construction; errors name the key, the value and the fix.
`config_hash()` covers exactly the fields every peer of a run must agree on. The [swarm] and
[control] sections live in config_network.py, [compression] in config_compression.py, the checks of single values
in config_checks.py.

    cfg = load_config("peer.toml", overrides={"inner.steps": 50, "model.stages": 4})
    print(to_toml(cfg))
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import tomli_w

from .config_checks import check_choices, coerce, fail
from .config_compression import TOPK_MAX_CHUNK, CompressionConfig
from .config_network import ControlConfig, SwarmConfig
from .errors import ConfigError
from .presets import PRESETS, ModelShape
from .wire import protocol_version

__all__ = [
    "TOPK_MAX_CHUNK",
    "CompressionConfig",
    "Config",
    "ControlConfig",
    "DataConfig",
    "InnerConfig",
    "ModelConfig",
    "ModelShape",
    "OuterConfig",
    "PRESETS",
    "RunConfig",
    "SwarmConfig",
    "config_hash",
    "default_overlap_steps",
    "from_dict",
    "shared_fields",
    "load_config",
    "parse_override",
    "to_dict",
    "to_toml",
]


OUTER_LR_BY_MODE = {"sync": 1.0, "delayed": 0.1, "eager": 0.2, "own": 0.35, "streaming": 0.7}
"""Outer lr defaults per mode: lr 0.7 + Nesterov 0.9 diverges with the one-step delay
(measured in shared/notes/outer-loop-variants.md), so `delayed` uses 0.1; `sync` at 1.0 / 0.7 was the best of
benchmarks/convergence.py's sweeps (DiLoCo's 0.7 / 0.9 did worse there and in the notes, on a 25M model too)."""
OUTER_MOMENTUM_BY_MODE = {"sync": 0.7, "own": 0.7}  # their best in the sweeps (notes/outer-loop-variants.md); others 0.9
TOPK_OUTER_LR_BY_MODE = {"sync": 4.0, "delayed": 2.0, "eager": 2.0, "own": 2.0, "streaming": 4.0}
"""With topk the outer step has no momentum (error feedback stands in for it), so it needs a larger lr:
the best of benchmarks/convergence.py's sweep (3 peers, tiny, 50 rounds x H=20; lr 5 and above did
worse, lr 6 and 8 diverged early)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    run_id: str = "dilocox"
    """Name of the training run; peers meet under it in the DHT."""
    seed: int = 0
    """Seed of the model initialization; every peer of a run uses the same one."""
    rounds: int = 100
    """Outer rounds the run lasts; a peer that joins late trains until this round."""
    run_dir: str = ""
    """Where checkpoints, metrics.jsonl and multiaddrs.txt go; empty means runs/<run_id>."""
    checkpoint_every: int = 1
    """Write a checkpoint every this many rounds (and at the end)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where inner training runs; auto picks cuda when available."""
    devices: tuple[str, ...] = ()
    """The GPU of each stage of this peer, in stage order (cuda:N, N as this process sees them: after
    CUDA_VISIBLE_DEVICES); empty: stage s on cuda:s (under torchrun, cuda:LOCAL_RANK). Two stages on one GPU is
    refused: NCCL carries activations between distinct GPUs only. With run.replicas, one per process: replica 0's
    stages, then replica 1's..."""
    replicas: int = 1
    """Copies of this peer's pipeline (data parallelism inside the peer, DP x PP: replicas x stages processes);
    each trains its share of every step's batch and they average their gradients every step (replicas.py)."""

    def __post_init__(self) -> None:
        check_choices(self, "run")
        for text in self.devices:
            if not re.fullmatch(r"cuda:\d+", text):
                fail("run.devices", list(self.devices), f"{text!r} is not cuda:N (one GPU per stage, in stage order)")
        if len(set(self.devices)) != len(self.devices):
            fail("run.devices", list(self.devices), "names a GPU twice: each stage needs its own")
        if self.devices and self.device == "cpu":
            fail("run.devices", list(self.devices), "names GPUs but run.device is cpu: drop one of them")
        if not self.run_id or any(c in self.run_id for c in " ./\\"):
            fail("run.run_id", self.run_id, "must be non-empty, without spaces, dots or slashes")
        if self.rounds < 1:
            fail("run.rounds", self.rounds, "must be at least 1")
        if self.checkpoint_every < 1:
            fail("run.checkpoint_every", self.checkpoint_every, "must be at least 1")
        if self.replicas < 1:
            fail("run.replicas", self.replicas, "must be at least 1")

    @property
    def path(self) -> Path:
        return Path(self.run_dir or f"runs/{self.run_id}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    preset: str = "tiny"
    """Model size: tiny (CPU tests), mini (~1.3M), small (~25M), 125m, 350m, 1b (presets.py)."""
    stages: int = 2
    """Pipeline stages per peer (M); each is one process holding a slice of the layers."""
    seq_len: int = 0
    """Context length in bytes; 0 means the preset's."""

    def __post_init__(self) -> None:
        check_choices(self, "model")
        if self.preset not in PRESETS:
            fail("model.preset", self.preset, f"unknown preset; choose one of {', '.join(PRESETS)}")
        if self.stages < 1:
            fail("model.stages", self.stages, "must be at least 1")
        if self.stages > self.shape.n_layer:
            fail(
                "model.stages",
                self.stages,
                f"preset {self.preset!r} has only {self.shape.n_layer} layers; use at most that many stages",
            )
        if self.seq_len < 0:
            fail("model.seq_len", self.seq_len, "must be positive (or 0 for the preset's)")

    @property
    def shape(self) -> ModelShape:
        base = PRESETS[self.preset]
        return dataclasses.replace(base, seq_len=self.seq_len or base.seq_len)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    paths: tuple[str, ...] = ()
    """Text files, directories or globs to train on; empty means the embedded Python stdlib corpus."""
    val_fraction: float = 0.02
    """Share of files held out for validation (chosen by a hash of the file path)."""
    val_batches: int = 4
    """Batches of held-out text evaluated after every round."""
    seed: int = -1
    """Seed of this peer's sampling order; -1 draws one at first start and keeps it in the run dir."""
    cache_dir: str = ""
    """Where the prepared corpus is cached and memory-mapped, once per machine (keyed by its files' names,
    sizes and times): "" = $DILOCOX_CACHE_DIR or ~/.cache/dilocox-p2p; "off" reads the files at every start."""

    def __post_init__(self) -> None:
        check_choices(self, "data")
        if not 0.0 < self.val_fraction < 0.5:
            fail("data.val_fraction", self.val_fraction, "must be between 0 and 0.5")
        if self.val_batches < 1:
            fail("data.val_batches", self.val_batches, "must be at least 1")
        if self.seed < -1:
            fail("data.seed", self.seed, "must be >= 0, or -1 for a random seed kept in the run dir")


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerConfig:
    steps: int = 100
    """Inner steps per round (H)."""
    batch_size: int = 16
    """Sequences per inner step on this peer."""
    microbatches: int = 4
    """Pipeline micro-batches per inner step; must divide batch_size. Local: a peer with less memory per device
    uses more, smaller ones (the same tokens per step, summed the same way up to float rounding)."""
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule of a peer of several stages (pipeline_schedule.py): 1f1b holds fewer micro-batches'
    activations at once, gpipe runs every forward before any backward; local."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """The inner optimizer (inner_optimizer.py): AdamW, or Muon on the transformer blocks' weight matrices with
    AdamW on the rest (embeddings, the output head, biases and norms; MuLoCo, arXiv 2505.23725). Muon's step is
    scaled to AdamW's update size, so both take the same lr and weight decay. Part of the run's recipe, as inner.lr:
    every peer of a run uses the same (theta_g would agree either way: it never sees the inner optimizer)."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum; inner.optimizer = muon only."""
    lr: float = 1e-3
    """Peak learning rate (both optimizers)."""
    warmup_steps: int = 50
    """Linear warm-up steps, counted over the whole run."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at the run's last inner step."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all stages) to this; 0 disables."""
    threads: int = 0
    """torch threads per stage process; 0 shares the machine's cores among the stage processes (of every replica)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Inner forward and backward: bf16 autocast (fp32 master weights and AdamW state, bf16 activations between
    stages) or fp32; auto = bf16 on CUDA, fp32 on CPU. theta_g and the outer step stay fp32 either way, so peers
    of a run may differ here and still agree bit for bit."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the stage (compile_scope); auto = on for CUDA, off on CPU. Falls back to eager, with a warning,
    where compilation is unavailable."""
    compile_scope: Literal["stage", "unit"] = "stage"
    """What one torch.compile graph holds: the whole stage (one graph: on an H200 at 350m, 1.46x the tokens/s of a
    graph per unit, docs/benchmarks.md section 3; the first step compiles for about 30 s), or each unit (a block,
    the embedding, the head; the blocks share one graph, so the first step takes a few seconds)."""
    checkpoint_activations: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them: less memory, about one
    more forward of compute."""

    def __post_init__(self) -> None:
        check_choices(self, "inner")
        for name in ("steps", "batch_size", "microbatches"):
            if getattr(self, name) < 1:
                fail(f"inner.{name}", getattr(self, name), "must be at least 1")
        if self.batch_size % self.microbatches:
            fail("inner.microbatches", self.microbatches, f"must divide inner.batch_size ({self.batch_size})")
        if self.lr <= 0:
            fail("inner.lr", self.lr, "must be positive")
        if self.warmup_steps < 0:
            fail("inner.warmup_steps", self.warmup_steps, "must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("inner.min_lr_ratio", self.min_lr_ratio, "must be between 0 and 1")
        if self.grad_clip < 0:
            fail("inner.grad_clip", self.grad_clip, "must be >= 0")
        if self.threads < 0:
            fail("inner.threads", self.threads, "must be >= 0")
        if not 0.0 <= self.muon_momentum < 1.0:
            fail("inner.muon_momentum", self.muon_momentum, "must be in [0, 1)")


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterConfig:
    mode: Literal["sync", "delayed", "eager", "own", "streaming"] = "sync"
    """When round t's average is applied: sync = at once (DiLoCo); delayed = end of round t+1 (DiLoCoX);
    eager and own apply it like delayed but start each round from theta_g plus this peer's own correction:
    eager swaps its stale contribution in the last average for its fresh one (Kale et al. 2025), own keeps
    the round's own progress (notes/outer-loop-variants.md: +5.9% over sync where naive delayed is +17%);
    streaming (Streaming DiLoCo, arXiv 2501.18512) syncs `fragments` strided layer groups one after another,
    each every H inner steps, and merges each average into the trained weights `overlap_steps` inner steps
    after its all-reduce started (README: Outer loop). The default, sync, is the only mode that stays within 2%
    of sync fp32 at equal tokens on the quality lab's long horizon (streaming ended 300 rounds 6.5% behind, and
    its hidden exchange did not make up for it on the 100 Mbit/s GPU setting: docs/benchmarks.md, section 7)."""
    lr: float = 0.0
    """Outer Nesterov learning rate; 0 means the mode's default (sync 1.0, delayed 0.1, eager 0.2, own 0.35,
    streaming 0.7; with compression topk, which has no outer momentum: sync 4.0, others 2.0)."""
    momentum: float = -1.0
    """Outer Nesterov momentum; -1 means the default: 0.9 (sync and own: 0.7), or 0 with compression.kind = topk, whose
    error feedback stands in for momentum (SparseLoCo; notes: keeping 0.9 on top costs 11 points)."""
    fragments: int = 1
    """streaming: P, the strided layer groups of each stage that sync in turn (fragment p holds the stage's
    layers k with k mod P = p); each all-reduce carries one fragment, so peak bytes/s fall about P times.
    At most the layers of the smallest stage; inner.steps must be a multiple of it."""
    overlap_steps: int = 0
    """streaming: tau, the inner steps a fragment's all-reduce may take before its average is merged
    (training waits only if it takes longer); 1 <= tau <= inner.steps / fragments. 0 means
    min(5, inner.steps / fragments) (Streaming DiLoCo's tau of 5 at H = 100; what the benchmarks ran)."""
    merge_alpha: float = 0.5
    """streaming: on arrival, theta_local <- alpha * theta_local + (1 - alpha) * theta_g for the fragment
    (0 takes theta_g as it is)."""

    def __post_init__(self) -> None:
        check_choices(self, "outer")
        if self.lr < 0:
            fail("outer.lr", self.lr, "must be positive (or 0 for the mode's default)")
        if self.momentum != -1.0 and not 0.0 <= self.momentum < 1.0:
            fail("outer.momentum", self.momentum, "must be in [0, 1), or -1 for the default")
        if self.fragments < 1:
            fail("outer.fragments", self.fragments, "must be at least 1")
        if self.fragments > 1 and self.mode != "streaming":
            fail("outer.fragments", self.fragments, f"fragments sync in turn only in mode streaming, not {self.mode}")
        if self.overlap_steps < 0:
            fail("outer.overlap_steps", self.overlap_steps, "must be at least 1 (or 0 for the default)")
        if not 0.0 <= self.merge_alpha < 1.0:
            fail("outer.merge_alpha", self.merge_alpha, "must be in [0, 1)")

    @property
    def effective_lr(self) -> float:
        return self.lr or OUTER_LR_BY_MODE[self.mode]

    @property
    def effective_momentum(self) -> float:
        return OUTER_MOMENTUM_BY_MODE.get(self.mode, 0.9) if self.momentum == -1.0 else self.momentum

    @property
    def syncs_per_round(self) -> int:
        """Sync events per outer round of H inner steps: P in streaming mode, else 1."""
        return self.fragments if self.mode == "streaming" else 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    control: ControlConfig = field(default_factory=ControlConfig)

    def __post_init__(self) -> None:
        shape = self.model.shape
        if shape.seq_len < 2:
            fail("model.seq_len", shape.seq_len, "must be at least 2")
        processes = self.model.stages * self.run.replicas
        if self.run.devices and len(self.run.devices) != processes:
            fail("run.devices", list(self.run.devices), f"names {len(self.run.devices)} GPUs for {processes} stage "
                 "processes (stages x replicas): one each, in stage order, replica after replica")  # fmt: skip
        if self.inner.batch_size % (self.run.replicas * self.inner.microbatches):
            fail("inner.batch_size", self.inner.batch_size, f"must be a multiple of run.replicas x inner.microbatches "
                 f"({self.run.replicas} x {self.inner.microbatches}): each replica trains an equal share of every "
                 "step's batch, in micro-batches")  # fmt: skip
        if self.model.stages > 1 and self.inner.microbatches < self.model.stages:
            fail("inner.microbatches", self.inner.microbatches,
                  f"must be at least model.stages ({self.model.stages}): the pipeline fills every stage with a "
                  "micro-batch (raise inner.microbatches, with inner.batch_size a multiple of it)")  # fmt: skip
        if self.compression.kind == "topk" and (self.outer.momentum == -1.0 or self.outer.lr == 0.0):
            momentum = 0.0 if self.outer.momentum == -1.0 else self.outer.momentum
            lr = self.outer.lr or TOPK_OUTER_LR_BY_MODE[self.outer.mode]
            object.__setattr__(self, "outer", dataclasses.replace(self.outer, momentum=momentum, lr=lr))
        sync_steps, rest = divmod(self.inner.steps, self.outer.syncs_per_round)
        if rest:
            fail("outer.fragments", self.outer.fragments,
                  f"inner.steps ({self.inner.steps}) must be a multiple of it: each fragment syncs every H steps, "
                  "offset by H / fragments")  # fmt: skip
        if self.outer.overlap_steps == 0:
            tau = default_overlap_steps(sync_steps)
            object.__setattr__(self, "outer", dataclasses.replace(self.outer, overlap_steps=tau))
        if self.outer.mode == "streaming" and self.outer.overlap_steps > sync_steps:
            fail("outer.overlap_steps", self.outer.overlap_steps,
                  f"must be at most inner.steps / fragments = {sync_steps}: a fragment's average is merged "
                  "before the next fragment syncs")  # fmt: skip


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}

# Fields peers may set differently: where they run, what they print, how they connect.
_LOCAL_FIELDS = {
    "run": {"run_dir", "checkpoint_every", "device", "devices", "replicas"},
    "data": {"paths", "seed", "cache_dir"},
    "swarm": {
        "enabled", "initial_peers", "host_maddrs", "announce_maddrs", "auto_relay", "reachability", "min_peers", "peer_wait", "helper_nice",
        "settled_nice", "identity", "certificate", "state_donors", "deadlines", "deadline_floor", "deadline_ceiling",
        "reuse_groups",
    },  # fmt: skip
    "control": {"progress", "log_level", "log_format", "control_addr", "metrics_addr"},
    "inner": {"threads", "precision", "compile", "compile_scope", "checkpoint_activations", "microbatches", "schedule"},
}


def default_overlap_steps(sync_steps: int) -> int:
    """streaming's tau when outer.overlap_steps is 0, for `sync_steps` = inner.steps / fragments."""
    return min(5, sync_steps)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        out[name] = {f.name: _plain(getattr(section, f.name)) for f in dataclasses.fields(section)}
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def to_toml(cfg: Config) -> str:
    return tomli_w.dumps(to_dict(cfg))


def shared_fields(cfg: Config) -> dict[str, dict[str, Any]]:
    """The fields all peers of a run must agree on, with defaults resolved (outer lr, seq_len)."""
    shared = to_dict(cfg)
    for section, names in _LOCAL_FIELDS.items():
        for name in names:
            shared[section].pop(name)
    shared["outer"]["lr"] = cfg.outer.effective_lr
    shared["outer"]["momentum"] = cfg.outer.effective_momentum
    shared["model"]["seq_len"] = cfg.model.shape.seq_len
    shared["wire"] = {"protocol": protocol_version()}  # peers running other code are other runs
    return shared


def config_hash(cfg: Config) -> str:
    """SHA-256 over the fields all peers of a run must share (model, data split, optimizers...)."""
    blob = json.dumps(shared_fields(cfg), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def from_dict(data: Mapping[str, Any], *, source: str = "config") -> Config:
    """Build a Config from nested plain values, checking every key and type."""
    sections: dict[str, Any] = {}
    for name, values in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{name}]; known sections: {', '.join(SECTIONS)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: [{name}] must be a table of keys, got {values!r}")
        sections[name] = _build_section(name, SECTIONS[name], values, source)
    try:
        return Config(**sections)
    except TypeError as e:  # pragma: no cover - guarded by _build_section
        raise ConfigError(f"{source}: {e}") from None


def _build_section(name: str, cls: type, values: Mapping[str, Any], source: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown key {name}.{key}; known keys in [{name}]: {', '.join(sorted(known))}")
        kwargs[key] = coerce(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse `section.key=value` (value in TOML syntax, bare words as strings)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set inner.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read a TOML file (optional), apply `section.key -> value` overrides, validate."""
    data: dict[str, dict[str, Any]] = {}
    source = "config"
    if path is not None:
        path = Path(path)
        source = str(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS:
            raise ConfigError(f"override {dotted}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
        data.setdefault(section, {})[key] = value
    return from_dict(data, source=source)
