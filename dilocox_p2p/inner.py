"""Inner training of one pipeline stage: PipelineStage + schedule + AdamW with warm-up and cosine.

Each stage worker owns its layers and their AdamW state (half of the dual optimizer
policy; the outer half lives in outer.py). Stages exchange activations over the peer's
local process group (gloo on CPU, NCCL on CUDA) through torch.distributed.pipelining.
The gradient norm for clipping is global: stages sum their squared norms in one small
all-reduce per step, which also carries the stop flag so all stages stop together.
A peer of one stage runs the same micro-batches in a plain loop, without the pipelining
package (whose import alone costs about a second of CPU at every start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Any

import torch
import torch.distributed as dist

from .config import Config
from .model import StageModule, build_stage, lm_loss

__all__ = ["InnerTrainer", "StepResult", "lr_at"]


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

    def __init__(self, cfg: Config, *, stage: int, device: torch.device, group: dist.ProcessGroup | None = None):
        self.cfg, self.stage, self.device, self.group = cfg, stage, device, group
        n_stages = cfg.model.stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.module: StageModule = build_stage(cfg.model.shape, n_stages, stage, cfg.run.seed).to(device)
        self.schedule = _pipeline_schedule(cfg, self.module, stage, device, group) if n_stages > 1 else None
        decay = [p for p in self.module.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.module.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.inner.lr,
            betas=(cfg.inner.beta1, cfg.inner.beta2),
            foreach=True,
        )
        self.total_steps = cfg.run.rounds * cfg.inner.steps

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def n_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def _run_schedule(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, *, train: bool) -> list:
        if self.schedule is None:
            return self._run_alone(inputs, targets, train=train)
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        args = (inputs.to(self.device),) if self.is_first and inputs is not None else ()
        target = targets.to(self.device) if self.is_last and targets is not None else None
        if self.is_last:
            run(*args, target=target, losses=losses)
        else:
            run(*args)
        return losses

    def _run_alone(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool) -> list[torch.Tensor]:
        """The whole model in this process: the schedule's micro-batches and loss scaling, without a pipeline."""
        n = self.cfg.inner.microbatches
        losses = []
        for x, y in zip(inputs.to(self.device).tensor_split(n), targets.to(self.device).tensor_split(n)):
            loss = lm_loss(self.module(x), y)
            if train:
                (loss / n).backward()
            losses.append(loss.detach())
        return losses

    def train_step(
        self, step: int, inputs: torch.Tensor | None, targets: torch.Tensor | None, *, stop: bool = False
    ) -> StepResult:
        """One inner step at global step `step` (sets the lr), with global-norm clipping."""
        lr = lr_at(
            step,
            peak=self.cfg.inner.lr,
            warmup=self.cfg.inner.warmup_steps,
            total=self.total_steps,
            min_ratio=self.cfg.inner.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        losses = self._run_schedule(inputs, targets, train=True)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local_sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        shared = torch.stack([local_sq.to(self.device), torch.tensor(float(stop), device=self.device)])
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(shared, group=self.group)
        total_norm = shared[0].sqrt().item()
        clip = self.cfg.inner.grad_clip
        if clip > 0 and total_norm > clip:
            torch._foreach_mul_(grads, clip / (total_norm + 1e-6))
        self.optimizer.step()
        loss = torch.stack(losses).mean().item() if losses else None
        return StepResult(loss=loss, stop=shared[1].item() > 0)

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


def _pipeline_schedule(cfg: Config, module: StageModule, stage: int, device: torch.device, group: Any) -> Any:
    """This stage's PipelineStage in the configured schedule (imported here: a peer of one stage never needs it)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    schedules = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    pipe = PipelineStage(module, stage, cfg.model.stages, device, group=group)
    return schedules[cfg.inner.schedule](pipe, n_microbatches=cfg.inner.microbatches, loss_fn=lm_loss, scale_grads=True)
