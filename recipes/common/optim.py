"""The recipes' optimizers and learning-rate schedule: SGD for ResNets, AdamW for transformers.

* ``sgd``: momentum 0.9, Nesterov, weight decay 5e-4 on every parameter (the usual CIFAR
  ResNet recipe).
* ``adamw``: betas (0.9, 0.999), decoupled weight decay 0.05 on the weight matrices and
  kernels only. No decay (the usual transformer recipe, as in DeiT/timm) on 1-d parameters:
  biases, the weights of every norm layer (body norms and QK-norms alike; MRSNorm's phasor
  weights too) and layer scales; nor on position embeddings and learned tokens (class,
  distillation, register tokens): those named by the model's ``no_weight_decay()`` (timm) or
  called like them (torchvision's ``pos_embedding``, ``class_token``).

Both use :func:`warmup_cosine`: linear warm-up from ``lr / warmup`` to ``lr``, then cosine decay
to 0 (or constant), stepped every optimizer step.

Example:
    >>> import timm
    >>> vit = timm.create_model("vit_tiny_patch16_224", img_size=8, patch_size=2, depth=1)
    >>> decay, no_decay = param_groups(vit, weight_decay=0.05)
    >>> decay["name"], decay["weight_decay"], no_decay["name"], no_decay["weight_decay"]
    ('decay', 0.05, 'no_decay', 0.0)
    >>> "pos_embed" in no_decay["param_names"], "blocks.0.attn.qkv.weight" in decay["param_names"]
    (True, True)
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from recipes.common.errors import UsageError

__all__ = ["DEFAULTS", "OPTIMIZERS", "build_optimizer", "eps_underflows", "no_decay_names", "optimizer_options",
           "param_groups", "run_schedule", "warmup_cosine"]

OPTIMIZERS = ("sgd", "adamw")
#: per optimizer: the defaults of the options left unset (``None``) on the command line
DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.1, "weight_decay": 5e-4, "momentum": 0.9, "nesterov": True},
    "adamw": {"lr": 1e-3, "weight_decay": 0.05, "betas": (0.9, 0.999)},
}
# position embeddings and learned tokens of models without timm's no_weight_decay() (torchvision ViT...)
_EMBEDDING_NAMES = re.compile(
    r"(pos_embed|pos_embedding|position_embeddings?|absolute_pos_embed|cls_token|class_token|dist_token|"
    r"reg_token|register_tokens)"
)


def no_decay_names(model: nn.Module) -> set[str]:
    """Names of ``model``'s parameters that AdamW leaves undecayed (see the module docstring)."""
    listed = model.no_weight_decay() if callable(getattr(model, "no_weight_decay", None)) else set()
    out = set()
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.ndim <= 1 or name in listed or _EMBEDDING_NAMES.fullmatch(leaf):
            out.add(name)
    return out


def param_groups(model: nn.Module, weight_decay: float, no_decay: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Two AdamW parameter groups, ``decay`` and ``no_decay`` (each with its ``param_names``).

    ``no_decay`` names more parameters to leave undecayed (the language model's token
    embeddings). Parameters that do not require gradients are left out; a group with no
    parameters is dropped.
    """
    skip = no_decay_names(model) | set(no_decay)
    groups: dict[str, dict[str, Any]] = {
        "decay": {"name": "decay", "weight_decay": weight_decay, "params": [], "param_names": []},
        "no_decay": {"name": "no_decay", "weight_decay": 0.0, "params": [], "param_names": []},
    }
    for name, p in model.named_parameters():
        if p.requires_grad:
            group = groups["no_decay" if name in skip else "decay"]
            group["params"].append(p)
            group["param_names"].append(name)
    return [g for g in groups.values() if g["params"]]


def optimizer_options(optimizer: str, **given: Any) -> dict[str, Any]:
    """The optimizer's options with its defaults (:data:`recipes.common.optim.DEFAULTS`) for those unset.

    An option of the other optimizer (``--model.momentum`` with ``adamw``...) is a mistake, not ignored.
    """
    if optimizer not in OPTIMIZERS:
        raise UsageError(f"--model.optimizer {optimizer!r} is not valid; choose one of {list(OPTIMIZERS)}.")
    defaults = DEFAULTS[optimizer]
    foreign = [k for k, v in given.items() if v is not None and k not in defaults]
    if foreign:
        other = next(o for o in OPTIMIZERS if o != optimizer)
        raise UsageError(f"--model.{foreign[0]} is an option of --model.optimizer {other}, not {optimizer}: "
                         f"leave it out, or choose --model.optimizer {other}.")
    chosen = {k: (given[k] if given[k] is not None else v) for k, v in defaults.items()}
    if chosen["lr"] <= 0:
        raise UsageError(f"--model.lr must be > 0, got {chosen['lr']}.")
    if chosen["weight_decay"] < 0:
        raise UsageError(f"--model.weight_decay must be >= 0, got {chosen['weight_decay']}.")
    betas = chosen.get("betas")
    if betas is not None and (len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas)):
        raise UsageError(f"--model.betas must be two numbers in [0, 1), e.g. [0.9, 0.999], got {list(betas)}.")
    if betas is not None:
        chosen["betas"] = tuple(float(b) for b in betas)
    return {**{k: None for k in given}, **chosen}


def build_optimizer(kind: str, model: nn.Module, params: Iterable[nn.Parameter], *, lr: float,
                    weight_decay: float, momentum: Optional[float] = None, nesterov: Optional[bool] = None,
                    betas: Optional[tuple[float, float]] = None) -> torch.optim.Optimizer:
    """SGD over ``params`` (weight decay on all), or AdamW over :func:`param_groups` of ``model``."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas))
    raise ValueError(f"unknown optimizer {kind!r}; choose one of {list(OPTIMIZERS)}")


def warmup_cosine(total: int, warmup: int, cosine: bool = True) -> Callable[[int], float]:
    """The lr factor of optimizer step ``step`` (0-based): linear warm-up, then cosine to 0 or constant.

    Example:
        >>> f = warmup_cosine(total=10, warmup=2)
        >>> [round(f(s), 3) for s in (0, 1, 2, 6, 10)]
        [0.5, 1.0, 1.0, 0.5, 0.0]
    """

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def run_schedule(trainer: Any, warmup_frac: float, schedule: str) -> Callable[[int], float]:
    """:func:`warmup_cosine` over the fit's optimizer steps (``trainer.estimated_stepping_batches``), warming up
    for ``warmup_frac`` of them; ``schedule`` ``"cosine"`` or ``"constant"``."""
    total = max(1, int(trainer.estimated_stepping_batches))
    return warmup_cosine(total, int(round(warmup_frac * total)), cosine=schedule == "cosine")


def eps_underflows(optimizer: torch.optim.Optimizer) -> list[torch.dtype]:
    """The parameter dtypes of ``optimizer`` in which a group's ``eps`` rounds to 0 (AdamW's 1e-8 in float16).

    There ``m / (sqrt(v) + eps)`` is 0/0 = NaN for every entry whose gradient is exactly 0 (an
    embedding row no token of the batch uses), at its first step: pure float16 with AdamW diverges
    for any norm (docs/results-lm.md, P1h).
    """
    found = []
    for group in optimizer.param_groups:
        eps = group.get("eps")
        for p in group["params"]:
            if eps is not None and p.dtype.is_floating_point and p.dtype not in found \
                    and torch.tensor(eps, dtype=p.dtype).item() == 0.0:
                found.append(p.dtype)
    return found
