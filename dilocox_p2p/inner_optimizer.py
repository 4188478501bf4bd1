"""The inner optimizer: AdamW over one stage's parameters, computed by torch's functional AdamW.

torch.optim.AdamW imports torch._dynamo at its first parameter group and at every step (its
methods are wrapped so that the compiler skips them): about 1 s of CPU at the start of every
stage process, which an eager peer otherwise never needs. On a loaded machine that second is
several of a restarted peer's. This class makes the same update with the same options through
`torch.optim.adamw.adamw`, the function torch.optim.AdamW.step calls, and keeps its state and its
`state_dict` layout: a checkpoint written by either loads into the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adamw import adamw

__all__ = ["InnerAdamW"]

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
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

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
