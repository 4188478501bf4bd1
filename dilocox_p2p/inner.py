"""Inner training of one pipeline stage: its pipeline schedule + AdamW with warm-up and cosine.

Each stage worker owns its layers and their AdamW state (half of the dual optimizer
policy; the outer half lives in outer.py). Stages exchange activations over the peer's
local process group (gloo on CPU, NCCL on CUDA) in a GPipe or 1F1B schedule (pipeline_schedule.py).
The gradient norm for clipping is global: stages sum their squared norms in one small
all-reduce per step, which also carries the stop flag so all stages stop together.
A peer of one stage runs the same micro-batches in a plain loop.

Data parallelism inside a peer (`replicas` > 1, with `replica_group`: the stage's copies in the other
pipeline replicas): each replica trains its 1/replicas of the step's batch through its own pipeline, and
the replicas average their gradients (one all-reduce per step, in a flat buffer) before the norm, the clip
and AdamW, so that every replica holds the same weights and a step is that of the whole batch.

On a GPU the stage trains as a plain bf16 loop would (inner.precision, inner.compile): bf16
autocast over fp32 master weights and AdamW state, TF32 for what stays fp32, fused AdamW,
the stage compiled, bf16 activations between stages, and one host sync per step. theta_g,
the pseudo-gradient and the outer step never see bf16: they read the fp32 master weights.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import Config
from .errors import StageOutOfMemory
from .inner_optimizer import InnerAdamW, InnerMuon
from .model import StageModule, build_stage, lm_loss, muon_matrices
from .pipeline_schedule import PipelineSchedule, bubble_fraction

__all__ = ["InnerTrainer", "StepResult", "compile_unavailable", "lr_at", "resolve_compile", "resolve_precision"]

logger = logging.getLogger(__name__)


def resolve_precision(choice: str, device: torch.device) -> str:
    """inner.precision for this device: auto is bf16 on CUDA, fp32 elsewhere."""
    if choice == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return choice


def resolve_compile(choice: str, device: torch.device) -> bool:
    """inner.compile for this device: auto compiles on CUDA only (on CPU the warm-up outweighs the gain)."""
    return choice == "on" or (choice == "auto" and device.type == "cuda")


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot build kernels for this device here, or None when it can."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "the triton package is missing (pip install triton)"
    if device.type == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++")):
        return "no C++ compiler on PATH (install g++)"
    return None


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up to `peak`, then cosine decay to `peak * min_ratio` at `total` steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class StepResult:
    loss: float | None  # mean micro-batch loss; only the last stage knows it
    stop: bool  # some stage of this peer was asked to stop


class InnerTrainer:
    """One stage's layers, its pipeline schedule and its inner optimizer."""

    def __init__(
        self, cfg: Config, *, stage: int, device: torch.device, group: dist.ProcessGroup | None = None,
        replicas: int = 1, replica_group: dist.ProcessGroup | None = None,
    ):  # fmt: skip
        """`group`: this replica's pipeline (its stages, in order); `replica_group`: this stage in every replica."""
        if replicas < 1 or cfg.inner.batch_size % (replicas * cfg.inner.microbatches):
            raise ValueError(f"{replicas} replicas of {cfg.inner.microbatches} micro-batches do not divide a batch of "
                             f"{cfg.inner.batch_size}")  # fmt: skip
        if replicas > 1 and (replica_group is None or dist.get_world_size(replica_group) != replicas):
            raise ValueError(f"{replicas} replicas need a process group of the stage's {replicas} copies")
        if replicas > 1 and cfg.model.stages > 1 and group is None:
            raise ValueError("replicas of a pipeline need each replica's own pipeline group (the world is all of them)")
        self.cfg, self.stage, self.device, self.group = cfg, stage, device, group
        self.replicas, self.replica_group = replicas, replica_group
        n_stages = cfg.model.stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.precision = resolve_precision(cfg.inner.precision, device)
        if device.type == "cuda":  # TF32 for the matmuls that stay fp32 (the optimizer's are elementwise)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.module: StageModule = build_stage(cfg.model.shape, n_stages, stage, cfg.run.seed).to(device)
        if self.precision == "bf16" and not self.is_last:
            self.module.boundary_dtype = torch.bfloat16  # half the bytes to the next stage, and back
        self.module.checkpoint_blocks = cfg.inner.checkpoint_activations
        self.compiled = resolve_compile(cfg.inner.compile, device) and self._compile()
        self._first_step_s: float | None = None
        self.schedule = self._pipeline_schedule(group) if n_stages > 1 else None
        self.optimizer = self._optimizer(cfg, device)
        self.total_steps = cfg.run.rounds * cfg.inner.steps
        logger.info("inner: %s on %s, %s", self.precision, device, "compiled" if self.compiled else "eager")

    def _optimizer(self, cfg: Config, device: torch.device) -> InnerAdamW | InnerMuon:
        """AdamW over the stage (weight decay on its matrices), or Muon on its blocks' matrices and AdamW on the
        rest (inner.optimizer)."""
        inner = cfg.inner
        kwargs: dict = {"lr": inner.lr, "betas": (inner.beta1, inner.beta2), "fused": device.type == "cuda"}
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        matrices = [p for p in self.module.parameters() if p.dim() >= 2]
        if inner.optimizer == "adamw":
            groups = [{"params": matrices, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
            return InnerAdamW(groups, **kwargs)
        blocks = muon_matrices(self.module)  # every stage holds a block (model.partition_units)
        in_blocks = {id(p) for p in blocks}
        others = [p for p in matrices if id(p) not in in_blocks]
        groups = [{"params": others, "weight_decay": inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return InnerMuon(blocks, groups, weight_decay=inner.weight_decay, momentum=inner.muon_momentum, **kwargs)

    def _pipeline_schedule(self, group: dist.ProcessGroup | None) -> PipelineSchedule:
        """This stage's part of the configured pipeline schedule (a peer of one stage needs none)."""
        shape, inner = self.cfg.model.shape, self.cfg.inner
        rows = inner.batch_size // self.replicas // inner.microbatches  # this replica's share, per micro-batch
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32  # what every boundary carries
        if self.stage == 0:
            bubble = bubble_fraction(self.cfg.model.stages, inner.microbatches)
            logger.info("pipeline: %s over %d stages in %d micro-batches of %d rows: each stage idles %.0f%% of a step "
                        "(the bubble, (S-1)/(M+S-1)); more micro-batches (--microbatches) shrink it", inner.schedule,
                        self.cfg.model.stages, inner.microbatches, rows, 100 * bubble)  # fmt: skip
        return PipelineSchedule(
            self.module, stage=self.stage, n_stages=self.cfg.model.stages, microbatches=inner.microbatches,
            boundary=((rows, shape.seq_len, shape.d_model), dtype), order=inner.schedule, loss_fn=lm_loss,
            device=self.device, group=group,
        )  # fmt: skip

    def _compile(self) -> bool:
        """Compile the stage (inner.compile_scope): each unit (the blocks share one compiled graph, so warm-up stays
        short), or the whole stage as one graph."""
        reason = compile_unavailable(self.device)
        if reason is not None:
            logger.warning("inner.compile: torch.compile is unavailable (%s); training eagerly", reason)
            return False
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True  # a unit that fails to compile runs eagerly, with dynamo's warning
        if self.cfg.inner.compile_scope == "stage":
            self.module.compile()
            return True
        for unit in self.module.layers:
            unit.compile()
        return True

    @contextmanager
    def _out_of_memory_explained(self, advice: Callable[[str], str] | None = None) -> Iterator[None]:
        """An allocation failure (in forward or backward, training or validation, unless `advice` says where
        else) becomes StageOutOfMemory, naming what shrinks the step."""
        advice = advice or self._memory_advice
        try:
            yield
        except torch.OutOfMemoryError as e:
            raise StageOutOfMemory(advice(str(e).splitlines()[0])) from None
        except RuntimeError as e:
            if "can't allocate memory" not in str(e):
                raise
            raise StageOutOfMemory(advice(str(e).splitlines()[-1].strip())) from None

    def _optimizer_memory_advice(self, what: str) -> str:
        """The optimizer's first step allocates its state: two fp32 moments per parameter (micro-batches do not
        change that, more stages do)."""
        n = self.n_params()
        gib = 8 * n / 2**30  # two fp32 moments; the fp32 weights and their gradients take as much again
        return (
            f"stage {self.stage} ran out of {self.device.type} memory in the inner optimizer step ({n:,} parameters: "
            f"AdamW keeps two fp32 moments per parameter, {gib:.2f} GiB, beside the weights and gradients, "
            f"{gib:.2f} GiB): {what}. Spread the parameters over more pipeline stages (--stages) or "
            "devices with more memory; more micro-batches do not help here"
        )

    def _memory_advice(self, what: str) -> str:
        inner, shape = self.cfg.inner, self.cfg.model.shape
        rows = inner.batch_size // self.replicas // inner.microbatches  # this replica's share, per micro-batch
        return (
            f"stage {self.stage} ran out of {self.device.type} memory in a forward or backward pass ({self.n_params():,} parameters, "
            f"micro-batches of {rows} x {shape.seq_len} tokens, {self.precision}"
            f"{', activations recomputed' if inner.checkpoint_activations else ''}): {what}. Make the step smaller: "
            f"more micro-batches (--microbatches, now {inner.microbatches}: it must divide --batch-size {inner.batch_size}, "
            "and peers of a run may differ in it), "
            "--set inner.checkpoint_activations=true, more pipeline stages (--stages), "
            f"{'--set inner.precision=bf16, ' if self.precision == 'fp32' and self.device.type == 'cuda' else ''}"
            "or a smaller --batch-size (every peer of the run must use the same)"
        )

    def autocast(self) -> AbstractContextManager:
        """The precision of forward and backward: bf16 autocast, or nothing for fp32."""
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def peak_memory(self) -> int | None:
        """Peak bytes of GPU memory this stage allocated since it started (None on CPU)."""
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def n_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def _run_schedule(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, *, train: bool) -> list:
        with self._out_of_memory_explained(), self.autocast():
            return self._run_pipeline(inputs, targets, train=train)

    def _run_pipeline(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, *, train: bool) -> list:
        if self.schedule is None:
            return self._run_alone(inputs, targets, train=train)
        run = self.schedule.step if train else self.schedule.eval
        x = inputs.to(self.device, non_blocking=True) if self.is_first and inputs is not None else None
        y = targets.to(self.device, non_blocking=True) if self.is_last and targets is not None else None
        return run(x, y)

    def _run_alone(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool) -> list[torch.Tensor]:
        """The whole model in this process: the schedule's micro-batches and loss scaling, without a pipeline."""
        n = self.cfg.inner.microbatches
        losses = []
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        for x, y in zip(inputs.tensor_split(n), targets.tensor_split(n)):
            loss = lm_loss(self.module(x), y)
            if train:
                (loss / n).backward()
            losses.append(loss.detach())
        return losses

    def forward_backward(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> list[torch.Tensor]:
        """The gradients of one batch, accumulated into the parameters' `.grad` (the schedule's micro-batches and
        loss scaling, as `train_step` takes them); the micro-batch losses (last stage). For trainers that handle
        the gradients themselves before the optimizer step (benchmarks/netns/baselines.py: DDP's all-reduce)."""
        return self._run_schedule(inputs, targets, train=True)

    def train_step(
        self, step: int, inputs: torch.Tensor | None, targets: torch.Tensor | None, *, stop: bool = False
    ) -> StepResult:
        """One inner step at global step `step` (sets the lr), with global-norm clipping; `inputs` and `targets`:
        this replica's share of the step's batch (all of it without replicas)."""
        lr = lr_at(
            step,
            peak=self.cfg.inner.lr,
            warmup=self.cfg.inner.warmup_steps,
            total=self.total_steps,
            min_ratio=self.cfg.inner.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter() if self._first_step_s is None else None
        self.optimizer.zero_grad(set_to_none=True)
        losses = self._run_schedule(inputs, targets, train=True)
        if self.replicas > 1:
            self._average_replicas()
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local_sq = torch.nn.utils.get_total_norm(grads).square() if grads else torch.zeros((), device=self.device)
        shared = torch.stack([local_sq.float(), torch.tensor(float(stop), device=self.device)])
        if self.cfg.model.stages > 1:  # the pipeline's stages: the global norm, and a stop for all of them
            dist.all_reduce(shared, group=self.group)
        clip = self.cfg.inner.grad_clip
        if clip > 0:  # torch's clamped coefficient, on the device: no host sync before the optimizer step
            torch.nn.utils.clip_grads_with_norm_(self.module.parameters(), clip, shared[0].sqrt())
        with self._out_of_memory_explained(self._optimizer_memory_advice):
            self.optimizer.step()
        loss = torch.stack(losses).mean().float() if losses else torch.zeros((), device=self.device)
        flags = torch.stack([shared[1], loss])
        if self.replicas > 1:  # a stop for every replica; the whole batch's loss (the replicas' shares are equal)
            dist.all_reduce(flags, group=self.replica_group)
            flags[1] /= self.replicas
        stop_flag, loss_value = flags.tolist()  # the step's one host sync
        if started is not None:
            self._first_step_s = time.perf_counter() - started
            if self.compiled:
                logger.info("inner: first step (compilation included) took %.1f s", self._first_step_s)
        return StepResult(loss=loss_value if losses else None, stop=stop_flag > 0)

    @torch.no_grad()
    def _average_replicas(self) -> None:
        """Every replica's gradients of this stage to their mean, in one all-reduce of a flat buffer (every replica
        gets the same bits back, so the replicas' weights stay equal)."""
        grads = [p.grad for p in self.module.parameters()]
        if any(g is None for g in grads):  # a stage that took no part in this step (none: every unit is used)
            raise RuntimeError("a parameter of this stage has no gradient to average across replicas")
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.replica_group)
        flat /= self.replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Mean loss over fixed batches (forward only); the last stage returns it, others None."""
        totals = []
        for inputs, targets in batches:
            losses = self._run_schedule(inputs, targets, train=False)
            if losses:
                totals.append(torch.stack(losses).mean())
        return torch.stack(totals).mean().item() if totals else None

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
