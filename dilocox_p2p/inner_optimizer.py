"""The inner optimizer: AdamW over one stage's parameters, computed by torch's functional AdamW (`InnerAdamW`), or
Muon on the transformer blocks' weight matrices beside it (`InnerMuon`, inner.optimizer = muon).

torch.optim.AdamW imports torch._dynamo at its first parameter group and at every step (its
methods are wrapped so that the compiler skips them): about 1 s of CPU at the start of every
stage process, which an eager peer otherwise never needs. On a loaded machine that second is
several of a restarted peer's. This class makes the same update with the same options through
`torch.optim.adamw.adamw`, the function torch.optim.AdamW.step calls, and keeps its state and its
`state_dict` layout: a checkpoint written by either loads into the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

__all__ = ["InnerAdamW", "InnerMuon", "orthogonalized"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class InnerAdamW:
    """AdamW (decoupled weight decay, no amsgrad) over parameter groups, each with its own weight decay.

    `fused` (CUDA) or `foreach` (otherwise), as torch.optim.AdamW takes them. The lr of each group
    may be set between steps through `param_groups`."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        fused: bool = False,
    ):
        self.param_groups: list[dict[str, Any]] = []
        for group in groups:
            self.param_groups.append({
                "weight_decay": float(group.get("weight_decay", 0.0)), "lr": lr, "betas": tuple(betas), "eps": eps,
                "amsgrad": False, "maximize": False, "foreach": None if fused else True, "capturable": False,
                "differentiable": False, "fused": True if fused else None, "decoupled_weight_decay": True,
                "params": list(group["params"]),
            })  # fmt: skip
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def _new_state(self, p: torch.Tensor, fused: bool) -> dict[str, torch.Tensor]:
        # as torch.optim.Adam: `step` stays on the host unless the fused kernel reads it on the device
        step = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
        return {"step": step, **{key: torch.zeros_like(p, memory_format=torch.preserve_format) for key in _MOMENTS}}

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grads((p for group in self.param_groups for p in group["params"]), set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (its state is made at its first)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            fused = bool(group["fused"])
            states = [self.state.get(p) or self.state.setdefault(p, self._new_state(p, fused)) for p in params]
            beta1, beta2 = group["betas"]
            adamw(
                params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [], [s["step"] for s in states],
                foreach=group["foreach"], capturable=False, differentiable=False, fused=group["fused"],
                grad_scale=None, found_inf=None, has_complex=any(torch.is_complex(p) for p in params),
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=False,
            )  # fmt: skip

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def steps_taken(self) -> list[float] | None:
        """Each parameter's step count, in group order; None until every parameter has taken a step."""
        params = self._params()
        if not all(p in self.state for p in params):
            return None
        return [float(self.state[p]["step"]) for p in params]

    def set_steps_taken(self, steps: list[float]) -> None:
        """Give every parameter a state (made as at its first step where it has none) with these step counts; the
        moments are then set in place (`moments`): a copy of another optimizer's state, as replicas.py sends it."""
        fused = {p: bool(g["fused"]) for g in self.param_groups for p in g["params"]}
        params = self._params()
        if len(steps) != len(params):
            raise ValueError(f"{len(steps)} step counts for {len(params)} parameters")
        for p, step in zip(params, steps):
            self.state.setdefault(p, self._new_state(p, fused[p]))["step"].fill_(step)

    def moments(self) -> list[torch.Tensor]:
        """Both moments of every parameter, in group order (every parameter has a state: `steps_taken`)."""
        return [self.state[p][key] for p in self._params() for key in _MOMENTS]

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Optimizer's layout: parameters numbered in group order, their state by number."""
        numbers: dict[torch.Tensor, int] = {}
        groups = []
        for group in self.param_groups:
            ids = [numbers.setdefault(p, len(numbers)) for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {numbers[p]: dict(s) for p, s in self.state.items() if p in numbers}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a state written by `state_dict` or by torch.optim.AdamW over the same parameter groups."""
        if "muon" in state_dict:
            raise ValueError(_OTHER_OPTIMIZER.format(saved="muon", this="adamw"))
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                f"the saved inner optimizer has parameter groups of {[len(g['params']) for g in saved]} tensors, "
                f"this stage {[len(g['params']) for g in self.param_groups]}: it was written for another model or stage"
            )
        by_number = {}
        for group, old in zip(self.param_groups, saved):
            by_number.update(zip(old["params"], group["params"]))
            group.update({k: v for k, v in old.items() if k in ("lr", "betas", "eps", "weight_decay")})
            group["betas"] = tuple(group["betas"])
        fused = {p: bool(g["fused"]) for g in self.param_groups for p in g["params"]}
        self.state = {}
        for number, values in state_dict["state"].items():
            p = by_number[int(number)]
            # as torch.optim.Adam loads it: the moments as the parameter, `step` in fp32 where the update reads it
            step = values["step"].detach().to(p.device if fused[p] else "cpu", torch.float32).clone()
            moments = {key: values[key].detach().to(p.device, p.dtype).clone() for key in _MOMENTS}
            self.state[p] = {"step": step, **moments}


def _zero_grads(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_().zero_()


_OTHER_OPTIMIZER = (
    "the saved inner optimizer state is inner.optimizer = {saved}'s, this stage runs {this}: resume with "
    "--set inner.optimizer={saved}, or start the stage's inner state afresh in a new run directory"
)


class InnerMuon:
    """Muon on the transformer blocks' weight matrices, AdamW (`InnerAdamW`) on every other parameter.

    Muon's step is torch.optim.Muon's (Nesterov momentum, then the update orthogonalized by 5 Newton-Schulz
    iterations of Keller Jordan's coefficients, decoupled weight decay, adjust_lr_fn = "match_rms_adamw": the
    update has AdamW's RMS, so the schedule's lr and the weight decay are AdamW's), computed here because torch
    runs the iterations in bf16: on a CPU without bf16 matrix units (AVX2) that is 9x slower than in fp32
    (tiny's 16 matrices: 0.21 s against 0.025 s a step), so this does them in fp32 off CUDA, in bf16 on it.
    The embeddings and the output head stay with AdamW, as in Muon's own recipe (MuLoCo, arXiv 2505.23725,
    trains DiLoCo's inner loop so).

    The interface is InnerAdamW's: `param_groups` (AdamW's, then Muon's: the schedule sets each one's lr),
    the step counts and moments a replica copies (replicas.py), and a `state_dict` of both parts."""

    def __init__(
        self,
        matrices: Iterable[torch.Tensor],
        others: Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        momentum: float,
        eps: float = 1e-8,
        fused: bool = False,
    ):
        matrices = list(matrices)
        if not matrices or any(p.dim() != 2 for p in matrices):
            raise ValueError("Muon needs at least one parameter, and only 2-D weight matrices")
        self.adamw = InnerAdamW(others, lr=lr, betas=betas, eps=eps, fused=fused)
        self.muon = {"params": matrices, "lr": lr, "weight_decay": weight_decay, "momentum": momentum}
        self.param_groups: list[dict[str, Any]] = [*self.adamw.param_groups, self.muon]
        self.buffers: dict[torch.Tensor, torch.Tensor] = {}  # each matrix's momentum, made at its first step
        self.muon_steps = 0

    @property
    def matrices(self) -> list[torch.Tensor]:
        return self.muon["params"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        _zero_grads(self.matrices, set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        self.adamw.step()
        lr, decay, momentum = self.muon["lr"], self.muon["weight_decay"], self.muon["momentum"]
        stepped = False
        for p in self.matrices:
            if p.grad is None:
                continue
            if (buffer := self.buffers.get(p)) is None:
                buffer = self.buffers[p] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffer.lerp_(p.grad, 1 - momentum)
            update = orthogonalized(p.grad.lerp(buffer, momentum))  # Nesterov
            p.mul_(1 - lr * decay)
            p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape)))  # AdamW's RMS
            stepped = True
        self.muon_steps += stepped

    def steps_taken(self) -> list[float] | None:
        """Each parameter's step count (AdamW's parameters, then the matrices); None until each took a step."""
        adamw = self.adamw.steps_taken()
        if adamw is None or not all(p in self.buffers for p in self.matrices):
            return None
        return [*adamw, *[float(self.muon_steps)] * len(self.matrices)]

    def set_steps_taken(self, steps: list[float]) -> None:
        n = len(steps) - len(self.matrices)
        if n < 0 or len(set(steps[n:])) != 1:
            raise ValueError(f"{len(steps)} step counts for {len(self.matrices)} Muon matrices and AdamW's "
                             "parameters (the matrices' all equal)")  # fmt: skip
        self.adamw.set_steps_taken(steps[:n])
        for p in self.matrices:
            self.buffers.setdefault(p, torch.zeros_like(p, memory_format=torch.preserve_format))
        self.muon_steps = int(steps[n])

    def moments(self) -> list[torch.Tensor]:
        """AdamW's moments, then each matrix's momentum (every parameter has a state: `steps_taken`)."""
        return [*self.adamw.moments(), *(self.buffers[p] for p in self.matrices)]

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state_dict, and the matrices' momentum by their number among the matrices."""
        buffers = {i: b for i, p in enumerate(self.matrices) if (b := self.buffers.get(p)) is not None}
        muon = {k: v for k, v in self.muon.items() if k != "params"}
        return {"adamw": self.adamw.state_dict(), "muon": {**muon, "matrices": len(self.matrices), "buffers": buffers},
                "muon_steps": self.muon_steps}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "muon" not in state_dict:
            raise ValueError(_OTHER_OPTIMIZER.format(saved="adamw", this="muon"))
        saved = state_dict["muon"]
        if saved["matrices"] != len(self.matrices):
            raise ValueError(f"the saved inner optimizer has {saved['matrices']} Muon matrices, this stage "
                             f"{len(self.matrices)}: it was written for another model or stage")  # fmt: skip
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.update({k: saved[k] for k in ("lr", "weight_decay", "momentum")})
        self.buffers = {p: saved["buffers"][i].detach().to(p.device, p.dtype).clone()
                        for i, p in enumerate(self.matrices) if i in saved["buffers"]}  # fmt: skip
        self.muon_steps = int(state_dict["muon_steps"])


_NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic coefficients, as torch.optim.Muon's


def orthogonalized(update: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """`update` with its singular values pushed towards 1 (about U V^T of its SVD) by Newton-Schulz iterations, as
    torch.optim.Muon computes it; in bf16 on CUDA (as torch), in fp32 elsewhere (see InnerMuon)."""
    a, b, c = _NEWTON_SCHULZ
    x = update.to(torch.bfloat16 if update.is_cuda else torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x
