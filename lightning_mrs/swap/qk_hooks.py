"""Per-head QK-norms on a projection's output, by hooks that follow whatever module sits there.

A transformers attention layer computes ``q = q_proj(h)`` (or a fused ``qkv``), reshapes it to
heads, applies the rotary embedding and attends. The QK-norm belongs right after the
projection and the head split, before the rotary embedding (where Qwen3 and Gemma 3 put theirs).
Nothing of the layer is copied or subclassed: :func:`attach` gives the layer ``q_norm``/``k_norm``
children and registers

* a forward hook on the projection (:class:`ProjectionNorm`) that applies them head by head to
  its output, and
* a forward pre-hook on the attention layer (:func:`follow`) that moves that hook onto whatever
  module holds the projection attribute *now*.

So the norm follows the projection, not a particular module: PEFT's LoRA replaces ``q_proj`` by a
``lora.Linear`` around the old one, and the hook moves onto the ``lora.Linear``, whose output is
``base(x) + B(A(x))``: the adapter adapts the projection *before* the norm, and
``merge_and_unload()`` (which puts a merged ``nn.Linear`` back) changes nothing. The same holds for
a quantized projection (bitsandbytes) or accelerate's per-instance ``forward`` (hooks run in
``Module.__call__``, around any ``forward``). A global module-registration hook
(``torch.nn.modules.module.register_module_module_registration_hook``) moves the hook as soon as
a projection is replaced through ``setattr``, before any forward (a model compiled after
``get_peft_model`` never sees the move); the pre-hook catches replacements made by writing
``_modules`` directly (bitsandbytes' converters do).

State lives in one plain attribute of the layer, ``_lightning_mrs_qk`` (a :class:`QKState`), and
the hooks are module-level callables: ``copy.deepcopy``, ``pickle`` and ``model.to()`` keep it
consistent, and the state-dict keys are the family's own plus ``<layer>.q_norm.weight``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> attn = nn.Module()
    >>> attn.q_proj, attn.k_proj = nn.Linear(8, 8), nn.Linear(8, 4)
    >>> attach(attn, Wiring({"q_proj": (("q", 2),), "k_proj": (("k", 1),)}, head_dim=4))
    >>> attn.q_norm = nn.RMSNorm(4)
    >>> y = attn.q_proj(torch.randn(3, 8))  # the hook normalises each of its 2 heads of 4
    >>> torch.allclose(y.unflatten(-1, (2, 4)).pow(2).mean(-1), torch.ones(3, 2), atol=1e-4)
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_mrs.swap.attention_info import QK_ATTRS

__all__ = ["ProjectionNorm", "QKState", "Split", "Wiring", "attach", "follow", "qk_state"]

Split = tuple[tuple[Optional[str], int], ...]  # (role "q"/"k" or None, heads) along the last dim, in order
_STATE = "_lightning_mrs_qk"


@dataclass(frozen=True)
class Wiring:
    """Where a layer's q and k come from: projection attribute -> its split.

    ``split`` lists the segments of the projection's last dim (``(("q", 4), ("k", 2), (None, 2))``:
    4 query heads, then 2 key heads, then 2 value heads); ``interleaved`` reads it as
    ``(heads, segments, head_dim)`` instead (GPT-NeoX).
    """

    projections: dict[str, Split]
    head_dim: int
    interleaved: bool = False

    @property
    def q_heads(self) -> int:
        return sum(h for split in self.projections.values() for r, h in split if r == "q")


@dataclass
class QKState:
    """A layer's QK-norm wiring and, per projection attribute, the module holding its hook."""

    wiring: Wiring
    hooked: dict[str, nn.Module] = field(default_factory=dict)


class ProjectionNorm:
    """The forward hook on a projection: its output with the owner's ``q_norm``/``k_norm`` per head.

    The owner (the attention layer) is held here, not as a child of the projection: its norms
    stay registered once, under ``<layer>.q_norm``.
    """

    def __init__(self, owner: nn.Module, attr: str) -> None:
        self.owner, self.attr = owner, attr

    def __call__(self, proj: nn.Module, args: Any, y: Tensor) -> Tensor:
        owner = self.owner
        wiring = owner.__dict__[_STATE].wiring
        split, d = wiring.projections[self.attr], wiring.head_dim
        if wiring.interleaved:
            t = y.unflatten(-1, (split[0][1], len(split), d))  # (..., H, parts, D)
            parts = [t[..., i, :] if role is None else getattr(owner, f"{role}_norm")(t[..., i, :])
                     for i, (role, _) in enumerate(split)]  # (..., H, D) each
            return torch.stack(parts, dim=-2).flatten(-3)
        chunks = y.split([h * d for _, h in split], dim=-1) if len(split) > 1 else (y,)
        parts = [c if role is None else getattr(owner, f"{role}_norm")(c.unflatten(-1, (h, d))).flatten(-2)
                 for (role, h), c in zip(split, chunks)]  # (..., H, D) per head inside
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def qk_state(module: nn.Module) -> Optional[QKState]:
    """The QK-norm wiring :func:`attach` gave ``module``, or ``None``."""
    state = module.__dict__.get(_STATE)
    return state if isinstance(state, QKState) else None


def _unhook(proj: nn.Module, owner: nn.Module) -> None:
    for key, hook in list(proj._forward_hooks.items()):
        if isinstance(hook, ProjectionNorm) and hook.owner is owner:
            del proj._forward_hooks[key]


def _hook(owner: nn.Module, state: QKState, attr: str) -> None:
    """Put the norm hook of ``attr`` on the module that holds it now (and off the previous one)."""
    current = owner._modules.get(attr)
    previous = state.hooked.get(attr)
    if previous is not None:
        _unhook(previous, owner)
    if current is None:
        raise RuntimeError(f"{type(owner).__qualname__}.{attr} was removed, but its QK-norm applies to its output")
    _unhook(current, owner)  # never twice
    current.register_forward_hook(ProjectionNorm(owner, attr))
    state.hooked[attr] = current


def follow(owner: nn.Module, args: Any) -> None:
    """Forward pre-hook on the attention layer: the norm hooks sit on the current projections."""
    state = owner.__dict__[_STATE]
    for attr in state.wiring.projections:
        if state.hooked.get(attr) is not owner._modules.get(attr):
            _hook(owner, state, attr)


def _on_register(parent: nn.Module, name: str, submodule: Optional[nn.Module]) -> None:
    """Global module-registration hook: a replaced projection takes the norm hook at once."""
    state = parent.__dict__.get(_STATE)
    if isinstance(state, QKState) and name in state.wiring.projections and submodule is not None:
        if state.hooked.get(name) is not submodule:
            parent._modules[name] = submodule  # the hook runs before the assignment
            _hook(parent, state, name)


_REGISTERED = False


def attach(owner: nn.Module, wiring: Wiring) -> None:
    """Give ``owner`` identity ``q_norm``/``k_norm`` applied per head to its projections' outputs
    (outputs unchanged until a norm is set); a second call only updates the wiring."""
    global _REGISTERED
    if not _REGISTERED:
        torch.nn.modules.module.register_module_module_registration_hook(_on_register)
        _REGISTERED = True
    state = qk_state(owner)
    if state is None:
        state = QKState(wiring)
        owner.__dict__[_STATE] = state
        owner.register_forward_pre_hook(follow)
    for attr in QK_ATTRS:
        if not isinstance(owner._modules.get(attr), nn.Module):
            setattr(owner, attr, nn.Identity())
    for attr in wiring.projections:
        _hook(owner, state, attr)
