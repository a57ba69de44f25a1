"""Pure float16 training as mixed-precision optimizers do it: float32 master weights and optimizer state.

Lightning's ``16-true`` casts the model to float16 and builds the optimizer on those float16
parameters: AdamW's state is float16 and its ``eps`` (1e-8) rounds to 0 there, so every run fails
at its second step whatever its norm (``docs/results-lm.md``, P1h). Training in float16 in practice
keeps a float32 master copy of every weight, applies the update to it in float32 with float32
optimizer state, and copies the result back to the float16 model (Micikevicius et al. 2018, "Mixed
Precision Training", ICLR, section 3.1; NVIDIA apex's ``FP16_Optimizer``; Megatron-LM's float16
optimizer). :class:`FP32MasterAdamW` does that around AdamW: the float16 gradients are copied to
float32, clipped there (by global norm, as apex clips the master gradients), stepped, and the
master weights rounded back into the model. No loss scaling (the papers add a scaler against
gradient underflow; here the model's float16 forward and backward are left as ``16-true`` has them,
so a small gradient may underflow to 0, which slows training but makes nothing non-finite).
Imported only where a cell trains.

Example:
    >>> from torch import nn
    >>> model = nn.Linear(3, 2).half()
    >>> opt = FP32MasterAdamW([{"params": list(model.parameters())}], lr=1e-2, max_grad_norm=1.0)
    >>> model(torch.randn(4, 3).half()).float().sum().backward()
    >>> _ = opt.step()
    >>> opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].dtype, model.weight.dtype
    (torch.float32, torch.float16)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["FP32MasterAdamW", "use_fp32_master"]


class FP32MasterAdamW(torch.optim.AdamW):
    """AdamW on float32 master copies of (float16) model parameters; the model gets the rounded result.

    Args:
        groups: the model's parameter groups (AdamW's hyperparameters per group).
        max_grad_norm: clip the float32 master gradients to this global norm before the step (``None``: no clip).
        **defaults: AdamW's arguments (``lr``, ``betas``, ``eps``, ``weight_decay``).
    """

    def __init__(self, groups: list[dict[str, Any]], max_grad_norm: Optional[float] = None, **defaults: Any) -> None:
        self.pairs: list[tuple[Tensor, Tensor]] = []  # (model parameter, its float32 master)
        masters = []
        for group in groups:
            params = []
            for p in group["params"]:
                m = p.detach().float().clone().requires_grad_(p.requires_grad)
                self.pairs.append((p, m))
                params.append(m)
            masters.append({**{k: v for k, v in group.items() if k not in ("params", "initial_lr")}, "params": params})
        self.max_grad_norm = max_grad_norm
        super().__init__(masters, **defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
        grads = [m for _, m in self.pairs if m.grad is not None]
        if self.max_grad_norm is not None and grads:
            torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        super().step()
        for p, m in self.pairs:
            p.copy_(m)  # rounded to the model's dtype
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p, _ in self.pairs:  # the model's own (float16) gradients, which backward accumulates into
            p.grad = None


def use_fp32_master(module: Any, max_grad_norm: Optional[float]) -> None:
    """Make a LightningModule whose ``configure_optimizers`` returns ``{"optimizer": AdamW, "lr_scheduler":
    {"scheduler": LambdaLR, ...}}`` train with :class:`FP32MasterAdamW` instead, same groups, same schedule.

    Clip here (``max_grad_norm``), not with the Trainer's ``gradient_clip_val``: the Trainer clips the
    optimizer's parameters, the masters, before their gradients exist.
    """
    original = module.configure_optimizers

    def configure_optimizers() -> dict[str, Any]:
        got = original()
        old, schedule = got["optimizer"], dict(got["lr_scheduler"])
        lr = module.hparams.lr
        groups = [dict(g, lr=lr) for g in old.param_groups]  # before the schedule's first factor
        new = FP32MasterAdamW(groups, max_grad_norm, lr=lr)
        schedule["scheduler"] = torch.optim.lr_scheduler.LambdaLR(new, schedule["scheduler"].lr_lambdas)
        return {"optimizer": new, "lr_scheduler": schedule}

    module.configure_optimizers = configure_optimizers
