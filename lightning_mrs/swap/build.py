"""Build one replacement norm from an old one: the class choice and the weight transfer.

Used by :func:`lightning_mrs.swap_norms`; see :class:`lightning_mrs.swap.SwapOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union

import torch
from torch import Tensor, nn

from lightning_mrs.modules import MRSNorm, MRSNorm2d
from lightning_mrs.swap.derf import Derf, Derf2d
from lightning_mrs.swap.dyt import DyT, DyT2d
from lightning_mrs.swap.half import MRSNormHalf, MRSNormHalfSafe, RMSNormHalf, RMSNormHalfSafe
from lightning_mrs.swap.layers import LayerNorm2d, NormAct, OffsetRMSNorm, RMSNorm2d
from lightning_mrs.swap.registry import NormSpec

__all__ = ["DEFAULT_EPS", "Plan", "accelerate_hooked", "build_replacement", "offloaded", "plan_replacement"]

_PER_SAMPLE_KINDS = ("batch", "group", "instance")  # spatial="auto" -> one statistic per sample
#: the experimental targets computed in the input's dtype (squares formed; "-safe": no intermediate overflow)
_HALF = {"rms-half": RMSNormHalf, "mrs-half": MRSNormHalf, "rms-half-safe": RMSNormHalfSafe,
         "mrs-half-safe": MRSNormHalfSafe}
#: the norm-free point-wise targets: (channels-last, channels-first) class
_POINTWISE = {"dyt": (DyT, DyT2d), "derf": (Derf, Derf2d)}
#: the eps of a new norm whose source has none (an added QK-norm, a norm without ``eps``)
DEFAULT_EPS = 1e-6


@dataclass(frozen=True)
class Plan:
    """What one norm becomes: a readable label and a constructor of the bare new norm."""

    label: str  # e.g. "MRSNorm2d(spatial=True)"
    make: Callable[[int, float, bool, dict], nn.Module]  # (C, eps, affine, device/dtype kwargs)


def accelerate_hooked(module: nn.Module) -> bool:
    """accelerate has hooked this module (``add_hook_to_module``: an ``_hf_hook`` and a per-instance
    ``forward`` bound to it), found without importing accelerate."""
    return "_hf_hook" in vars(module)


def offloaded(module: nn.Module) -> bool:
    """accelerate keeps this module's weights elsewhere (CPU or disk offload: its parameters are
    on ``meta`` and its hook loads them for each forward); a replacement cannot take them."""
    hook = vars(module).get("_hf_hook")
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])  # SequentialHook holds several
    return any(getattr(h, "offload", False) or getattr(h, "weights_map", None) is not None for h in hooks)


def _auto_spatial(spec: NormSpec) -> bool:
    if spec.kind in _PER_SAMPLE_KINDS:
        return True
    return bool(spec.spatial)


def plan_replacement(module: nn.Module, spec: NormSpec, target: str, spatial: object,
                     scalars: Optional[Mapping[str, float]] = None) -> Union[Plan, str, None]:
    """The replacement of ``module`` for ``target``, ``None`` when it already is one, or why it cannot be.

    ``spatial`` is ``"auto"``, ``True`` or ``False`` (channels-first sources only); ``scalars`` the initial
    scalars of a DyT or Derf (``{"alpha0": ..., "shift0": ...}``, each the class's default where absent).
    """
    if target in _POINTWISE:  # element-wise: per sample or per position is moot; a bias where the source has one
        if spec.kind == target:
            return None
        cls = _POINTWISE[target][spec.channel_dim != -1]
        bias = _tensor(module, "bias") is not None or (spec.formula is not None and spec.formula.bias)
        initial = {**cls.DEFAULTS, **(scalars or {})}
        label = ", ".join(f"{k}={v:g}" for k, v in initial.items())
        return Plan(f"{cls.__name__}({label})", lambda c, e, a, dd: cls(c, e, a, bias=bias, **initial, **dd))
    if target in _HALF:  # experimental baselines (lightning_mrs.swap.half): channels-last sources only
        if spec.channel_dim != -1:
            return (f"target={target!r} is an experimental channels-last baseline; this norm is channels-first "
                    "(keep it, exclude it, or use target='rms'/'mrs')")
        if spec.kind == target:
            return None
        if target.startswith("mrs-") and spec.num_channels % 2:
            return f"odd channel count {spec.num_channels}: MRSNorm pairs adjacent channels; keep or exclude this norm"
        return Plan(_HALF[target].__name__, lambda c, e, a, dd: _HALF[target](c, e, a, **dd))
    if spec.channel_dim == -1:
        if target == "mrs":
            return None if spec.kind == "mrs" else Plan("MRSNorm", lambda c, e, a, dd: MRSNorm(c, e, a, **dd))
        if target == "layer":
            if spec.kind == "layer":
                return None
            return Plan("LayerNorm", lambda c, e, a, dd: nn.LayerNorm(c, e, elementwise_affine=a, bias=a, **dd))
        if spec.kind == "rms":
            return None
        if spec.formula is not None and spec.formula.weight == "1+w":  # Gemma: keep its checkpoint convention
            return Plan("RMSNorm(offset=1)", lambda c, e, a, dd: OffsetRMSNorm(c, e, a, offset=1.0, **dd))
        return Plan("RMSNorm", lambda c, e, a, dd: nn.RMSNorm(c, e, elementwise_affine=a, **dd))
    s = _auto_spatial(spec) if spatial == "auto" else bool(spatial)
    if target == "mrs":
        if spec.kind == "mrs" and bool(spec.spatial) == s:
            return None
        return Plan(f"MRSNorm2d(spatial={s})", lambda c, e, a, dd: MRSNorm2d(c, e, a, spatial=s, **dd))
    if target == "rms":
        if spec.kind == "rms2d" and bool(spec.spatial) == s and not spec.fused_act:
            return None
        return Plan(f"RMSNorm2d(spatial={s})", lambda c, e, a, dd: RMSNorm2d(c, e, a, spatial=s, **dd))
    if s:  # per-sample LayerNorm of a conv net: GroupNorm with one group
        if spec.kind == "group" and getattr(module, "num_groups", None) == 1:
            return None
        return Plan("GroupNorm(1)", lambda c, e, a, dd: nn.GroupNorm(1, c, e, affine=a, **dd))
    if spec.kind == "layer2d":
        return None
    return Plan("LayerNorm2d", lambda c, e, a, dd: LayerNorm2d(c, e, a, **dd))


def _tensor(module: nn.Module, name: str) -> Optional[Tensor]:
    value = getattr(module, name, None)
    return value if isinstance(value, Tensor) else None


def _device_dtype(module: nn.Module) -> dict:
    for t in (_tensor(module, "weight"), _tensor(module, "bias"), *module.parameters(recurse=False), *module.buffers(recurse=False)):
        if t is not None and t.is_floating_point():
            return {"device": t.device, "dtype": t.dtype}
    return {}


def _offset(module: nn.Module, spec: NormSpec) -> float:
    """The constant a layer adds to its weight: 1 for Gemma-style (probed ``1 + w``) layers."""
    if spec.formula is not None:
        return 1.0 if spec.formula.weight == "1+w" else 0.0
    return module.offset if isinstance(module, OffsetRMSNorm) else 0.0


def _per_channel(weight: Tensor, old_kind: str) -> Tensor:
    """The old weight as one value per channel (an MRS weight holds one per phasor)."""
    return weight.repeat_interleave(2) if old_kind in ("mrs", "mrs-half", "mrs-half-safe") else weight


@torch.no_grad()
def build_replacement(module: nn.Module, spec: NormSpec, plan: Plan, init: str, eps: Optional[float]) -> nn.Module:
    """Create the new norm on the old one's device/dtype, with its ``requires_grad`` and
    ``training`` flags, and (``init="inherit"``) its weights; fused ``drop``/``act`` kept.

    A probed layer (``spec.formula``, :mod:`lightning_mrs.swap.probe`) gives its probed eps and
    its effective per-channel scale: ``1 + w`` for an offset layer (Gemma), none without weight.
    """
    weight, bias = _tensor(module, "weight"), _tensor(module, "bias")
    old_eps = spec.formula.eps if spec.formula is not None else getattr(module, "eps", None)
    if eps is None:
        eps = float(old_eps) if isinstance(old_eps, (int, float)) and old_eps > 0 else DEFAULT_EPS
    new = plan.make(spec.num_channels, eps, weight is not None, _device_dtype(module))
    # A frozen source (requires_grad=False, or a buffer as in FrozenBatchNorm2d) stays frozen.
    trainable = weight.requires_grad if isinstance(weight, nn.Parameter) else weight is None
    for p in new.parameters():
        p.requires_grad_(trainable)
    if init in ("inherit", "calibrate") and weight is not None and getattr(new, "weight", None) is not None:
        raw = _per_channel(weight.detach(), spec.kind)  # (C,)
        offset = _offset(module, spec)  # the source's scale is offset + raw (Gemma: 1 + w)
        if isinstance(new, OffsetRMSNorm) and offset == new.offset:
            w = raw  # the same convention: the very weights (a plain reload of the family gives this layer)
        else:
            w = raw + offset if offset else raw  # the effective per-channel scale
            w = w - new.offset if isinstance(new, OffsetRMSNorm) else w
        if isinstance(new, (MRSNorm, MRSNorm2d, MRSNormHalf)):
            # one weight per phasor from its two channels: the mean keeps zero-init zeros zero
            w = w.reshape(-1, 2).mean(dim=1)  # (C/2,)
        new.weight.copy_(w)
        new_bias = getattr(new, "bias", None)
        if isinstance(new_bias, Tensor):
            new_bias.copy_(bias.detach() if bias is not None and bias.shape == new_bias.shape else torch.zeros_like(new_bias))
    new.train(module.training)
    if spec.formula is not None:  # what the old layer computed, for the checkpoint record (spec.py)
        new.swapped_from = f"{type(module).__qualname__}: {spec.formula}"
    if accelerate_hooked(module):
        # the old hook (inputs moved to its execution device) goes on the new layer: it is
        # re-initialised there (accelerate's own add_hook_to_module), nothing of the old forward is copied
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(new, vars(module)["_hf_hook"])
    if spec.fused_act:
        drop, act = getattr(module, "drop", None), getattr(module, "act", None)
        holder = NormAct(new, drop if isinstance(drop, nn.Module) else None, act if isinstance(act, nn.Module) else None)
        holder.training = module.training  # drop/act keep their own flags
        return holder
    return new
