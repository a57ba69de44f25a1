"""Which modules are norm layers, and how they lay out their channels.

One table maps norm classes of torch, torchvision, timm and lightning-mrs to a
:class:`NormSpec`. Lookup walks the module's MRO, so the most specific registered class
wins: timm's ``LayerNorm2d`` subclasses ``nn.LayerNorm`` but is channels-first, and its
own entry is found before ``nn.LayerNorm``'s. A subclass that is not registered inherits its
parent's entry unless it overrides ``forward`` (then nobody knows its layout, and the spec
says so in ``unsupported``).

timm and torchvision are optional: their classes are registered (on the first lookup) only
when importable. Register your own norm classes with :func:`register_norm`, as this module
does for lightning-mrs's own layers; a class you register keeps your entry.

Example:
    >>> from torch import nn
    >>> norm_spec(nn.BatchNorm2d(8))
    NormSpec(kind='batch', num_channels=8, channel_dim=1, spatial=None, fused_act=False, unsupported=None)
    >>> [name for name, _, _ in iter_norm_layers(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))]
    ['1']
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

from torch import nn

from lightning_mrs.modules import MRSNorm, MRSNorm2d
from lightning_mrs.swap.derf import Derf, Derf2d
from lightning_mrs.swap.dyt import DyT, DyT2d
from lightning_mrs.swap.half import MRSNormHalf, MRSNormHalfSafe, RMSNormHalf, RMSNormHalfSafe
from lightning_mrs.swap.hf import known_norm
from lightning_mrs.swap.layers import LayerNorm2d, OffsetRMSNorm, RMSNorm2d
from lightning_mrs.swap.probe import Formula, recognise

__all__ = ["NormSpec", "norm_spec", "iter_norm_layers", "register_norm", "NORM_KINDS"]

#: kind -> what it normalises over; used in docs, validation and the swap's "auto" rules.
NORM_KINDS: dict[str, str] = {
    "batch": "BatchNorm: per channel over the batch (and positions); running stats",
    "group": "GroupNorm: per sample over channel groups and positions",
    "instance": "InstanceNorm: per sample and channel over positions",
    "layer": "LayerNorm over the last dim (channels-last)",
    "layer2d": "LayerNorm over dim 1 at each position (channels-first, ConvNeXt style)",
    "rms": "RMSNorm over the last dim (channels-last)",
    "rms2d": "RMSNorm over dim 1 (channels-first; per position or per sample)",
    "simple": "SimpleNorm x/std(x) over the last dim (channels-last)",
    "simple2d": "SimpleNorm over dim 1 at each position (channels-first)",
    "mrs": "MRSNorm (lightning-mrs): MRSNorm is channels-last, MRSNorm2d channels-first",
    "evo": "EvoNorm (fused norm+act with learned non-linearity)",
    "frn": "FilterResponseNorm (+TLU)",
    "grn": "GlobalResponseNorm (ConvNeXt V2 feature competition)",
    "lrn": "LocalResponseNorm",
    "inplace_abn": "InPlaceABN (fused BN+act from the inplace_abn package)",
    "lazy": "uninitialised lazy BatchNorm/InstanceNorm",
    "custom": "a subclass of a known norm with its own forward",
    "rms-half": "RMSNormHalf (experimental): RMSNorm over the last dim computed in the input's dtype, squares formed",
    "mrs-half": "MRSNormHalf (experimental): MRSNorm over the last dim computed in the input's dtype, squares formed",
    "rms-half-safe": "RMSNormHalfSafe (experimental): RMSNormHalf scaled by max|x| before squaring (no overflow)",
    "mrs-half-safe": "MRSNormHalfSafe (experimental): MRSNormHalf with magnitudes by hypot (no overflow)",
    "dyt": "DyT (Dynamic Tanh, lightning-mrs): element-wise w * tanh(alpha * x) + b, no statistic; DyT is "
           "channels-last, DyT2d channels-first",
    "derf": "Derf (Dynamic erf, lightning-mrs): element-wise w * erf(alpha * x + s) + b, no statistic; Derf is "
            "channels-last, Derf2d channels-first",
    "probed": "a class the table does not know (a transformers *RMSNorm...), recognised by running it: RMS or "
              "LayerNorm over the last dim (NormSpec.formula; lightning_mrs.swap.probe)",
}


@dataclass(frozen=True)
class NormSpec:
    """What a norm layer normalises, as far as a swap needs to know.

    Attributes:
        kind: one of :data:`NORM_KINDS` (``"batch"``, ``"layer2d"``, ``"mrs"``...).
        num_channels: ``C``, the size of the channel dim (for a multi-dim LayerNorm, the
            size of its last dim; see ``unsupported``).
        channel_dim: ``1`` for channels-first ``(N, C, *spatial)``, ``-1`` for channels-last.
        spatial: channels-first only. ``True``: one statistic per sample over all positions
            (GroupNorm, InstanceNorm, ``MRSNorm2d(spatial=True)``); ``False``: one per
            position (LayerNorm2d, RmsNorm2d); ``None``: batch statistics, channels-last, or no statistic (DyT2d).
        fused_act: the layer applies its own ``drop`` then ``act`` submodules after the norm
            (timm ``BatchNormAct2d`` & co); a swap must keep them.
        unsupported: why no faithful per-channel replacement exists (EvoNorm, multi-dim
            ``normalized_shape``, a custom ``forward``...), or ``None``.
        formula: ``kind="probed"`` only: what the probe found the layer computes (RMS or
            LayerNorm, the weight as ``w`` or ``1 + w``, the bias, eps).

    Example:
        >>> norm_spec(nn.GroupNorm(1, 8))
        NormSpec(kind='group', num_channels=8, channel_dim=1, spatial=True, fused_act=False, unsupported=None)
    """

    kind: str
    num_channels: int
    channel_dim: int
    spatial: Optional[bool] = None
    fused_act: bool = False
    unsupported: Optional[str] = None
    formula: Optional[Formula] = field(default=None, repr=False)


@dataclass(frozen=True)
class _Entry:
    kind: str
    channel_dim: Union[int, Callable[[nn.Module], int]]
    spatial: Union[Optional[bool], Callable[[nn.Module], Optional[bool]]] = None
    fused_act: bool = False
    unsupported: Optional[str] = None


_REGISTRY: dict[type, _Entry] = {}
_BUILTINS_LOADED = False


def register_norm(
    cls: type,
    kind: str,
    channel_dim: Union[int, Callable[[nn.Module], int]],
    *,
    spatial: Union[Optional[bool], Callable[[nn.Module], Optional[bool]]] = None,
    fused_act: bool = False,
    unsupported: Optional[str] = None,
) -> None:
    """Teach the registry (and so :func:`lightning_mrs.swap_norms`) a norm class.

    The channel count is read from ``num_features``, ``num_channels``,
    ``normalized_shape`` or ``weight``, in that order.

    Args:
        cls: the norm class; its subclasses inherit the entry unless they override forward.
        kind: one of :data:`NORM_KINDS`.
        channel_dim: ``1`` (channels-first) or ``-1`` (channels-last), or a function of the
            module returning it.
        spatial: see :class:`NormSpec`; a value or a function of the module.
        fused_act: the module has ``drop``/``act`` children applied after the norm.
        unsupported: a reason to never swap it.

    Example:
        >>> class MyLN(nn.LayerNorm):
        ...     def forward(self, x):
        ...         return super().forward(x.movedim(1, -1)).movedim(-1, 1)
        >>> register_norm(MyLN, "layer2d", 1, spatial=False)
        >>> norm_spec(MyLN(6)).channel_dim
        1
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_norm: cls must be an nn.Module subclass, got {cls!r}.")
    if kind not in NORM_KINDS:
        raise ValueError(f"register_norm({cls.__name__}): unknown kind {kind!r}; valid: {sorted(NORM_KINDS)}.")
    if channel_dim not in (1, -1) and not callable(channel_dim):
        raise ValueError(f"register_norm({cls.__name__}): channel_dim must be 1 or -1, got {channel_dim!r}.")
    _REGISTRY[cls] = _Entry(kind, channel_dim, spatial, fused_act, unsupported)


def _add(module_name: str, names: Union[str, tuple[str, ...]], entry: _Entry) -> None:
    """Register classes of an optional package; silently absent when it is not installed."""
    try:
        mod = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - optional dependency (timm / torchvision / inplace_abn)
        return
    for name in (names,) if isinstance(names, str) else names:
        cls = getattr(mod, name, None)
        if isinstance(cls, type):
            _REGISTRY.setdefault(cls, entry)  # a user's register_norm wins


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    from torch.nn.modules import batchnorm, instancenorm

    cf, cl = 1, -1
    put = _REGISTRY.setdefault  # a user's register_norm wins
    # --- torch (bases cover BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d)
    put(batchnorm._BatchNorm, _Entry("batch", cf))
    put(nn.SyncBatchNorm, _Entry("batch", cf))
    put(instancenorm._InstanceNorm, _Entry("instance", cf, True))
    lazy = "uninitialised lazy norm: run one forward pass before swapping"
    put(batchnorm._LazyNormBase, _Entry("lazy", cf, unsupported=lazy))
    put(nn.GroupNorm, _Entry("group", cf, True))
    put(nn.LayerNorm, _Entry("layer", cl))
    if hasattr(nn, "RMSNorm"):
        put(nn.RMSNorm, _Entry("rms", cl))
    lrn = "LocalResponseNorm normalises across neighbouring channels; no per-channel equivalent"
    put(nn.LocalResponseNorm, _Entry("lrn", cf, unsupported=lrn))
    put(nn.CrossMapLRN2d, _Entry("lrn", cf, unsupported=lrn))
    # --- torchvision
    _add("torchvision.ops.misc", "FrozenBatchNorm2d", _Entry("batch", cf))
    _add("torchvision.models.convnext", "LayerNorm2d", _Entry("layer2d", cf, False))
    # --- timm (norm.py, norm_act.py, split_batchnorm.py, evo_norm.py, ...)
    tn, ta = "timm.layers.norm", "timm.layers.norm_act"
    _add(tn, ("GroupNorm", "GroupNorm1"), _Entry("group", cf, True))
    _add(tn, ("LayerNorm", "LayerNormFp32"), _Entry("layer", cl))
    _add(tn, ("LayerNorm2d", "LayerNorm2dFp32", "LayerNormExp2d"), _Entry("layer2d", cf, False))
    _add(tn, ("RmsNorm", "RmsNormFp32"), _Entry("rms", cl))
    _add(tn, ("RmsNorm2d", "RmsNorm2dFp32"), _Entry("rms2d", cf, False))
    _add(tn, ("SimpleNorm", "SimpleNormFp32"), _Entry("simple", cl))
    _add(tn, ("SimpleNorm2d", "SimpleNorm2dFp32"), _Entry("simple2d", cf, False))
    _add(ta, ("BatchNormAct2d", "SyncBatchNormAct", "FrozenBatchNormAct2d"), _Entry("batch", cf, None, True))
    _add("timm.layers.split_batchnorm", "SplitBatchNorm2d", _Entry("batch", cf))
    _add(ta, ("GroupNormAct", "GroupNorm1Act"), _Entry("group", cf, True, True))
    _add(ta, ("LayerNormAct", "LayerNormActFp32"), _Entry("layer", cl, None, True))
    _add(ta, ("LayerNormAct2d", "LayerNormAct2dFp32"), _Entry("layer2d", cf, False, True))
    _add(ta, ("RmsNormAct", "RmsNormActFp32"), _Entry("rms", cl, None, True))
    _add(ta, ("RmsNormAct2d", "RmsNormAct2dFp32"), _Entry("rms2d", cf, False, True))
    evo = "EvoNorm learns its own non-linearity inside the norm; no faithful MRS replacement"
    for name in ("EvoNorm2dB0", "EvoNorm2dB1", "EvoNorm2dB2", "EvoNorm2dS0", "EvoNorm2dS0a",
                 "EvoNorm2dS1", "EvoNorm2dS1a", "EvoNorm2dS2", "EvoNorm2dS2a"):
        _add("timm.layers.evo_norm", name, _Entry("evo", cf, unsupported=evo))
    frn = "FilterResponseNorm has no mean/variance and a learned threshold (TLU); no faithful MRS replacement"
    _add("timm.layers.filter_response_norm", ("FilterResponseNormTlu2d", "FilterResponseNormAct2d"), _Entry("frn", cf, unsupported=frn))
    grn = "GlobalResponseNorm is a feature-competition layer on top of the residual, not a norm to replace"
    _add("timm.layers.grn", "GlobalResponseNorm", _Entry("grn", lambda m: getattr(m, "channel_dim", -1), unsupported=grn))
    abn = "InPlaceABN is a fused, in-place BN+act kernel; no faithful MRS replacement"
    _add("timm.layers.inplace_abn", "InplaceAbn", _Entry("inplace_abn", cf, unsupported=abn))


def _num_channels(module: nn.Module) -> tuple[int, Optional[str]]:
    """``C`` of a norm module, and a reason when its normalised shape is not one channel dim."""
    for attr in ("num_features", "num_channels"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value, None
    shape = getattr(module, "normalized_shape", None)
    if shape is not None:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if len(shape) != 1:
            return int(shape[-1]) if shape else 0, (
                f"multi-dim normalized_shape {shape} normalises over {len(shape)} dims "
                f"({math.prod(shape)} values) together, not over one channel dim"
            )
        return int(shape[0]), None
    weight = getattr(module, "weight", None)
    if weight is not None and getattr(weight, "ndim", 0) == 1:
        return int(weight.shape[0]), None
    return 0, "cannot tell its channel count"


def _lookup(cls: type) -> tuple[Optional[type], Optional[_Entry]]:
    _load_builtins()
    for klass in cls.__mro__:
        entry = _REGISTRY.get(klass)
        if entry is not None:
            return klass, entry
    return None, None


def norm_spec(module: nn.Module) -> Optional[NormSpec]:
    """The :class:`NormSpec` of ``module``, or ``None`` when it is not a norm layer.

    Norm layers that a swap cannot replace faithfully still get a spec (their ``kind``
    says what they are), with the reason in ``spec.unsupported``.

    Example:
        >>> norm_spec(nn.LayerNorm(8)).channel_dim, norm_spec(nn.Linear(2, 2))
        (-1, None)
    """
    cls = type(module)
    base, entry = _lookup(cls)
    if entry is None:
        return _probed(module)
    channel_dim = entry.channel_dim(module) if callable(entry.channel_dim) else entry.channel_dim
    spatial = entry.spatial(module) if callable(entry.spatial) else entry.spatial
    channels, reason = _num_channels(module)
    reason = entry.unsupported or reason
    if base is not cls and reason is None:
        # An unregistered subclass that rewrites forward may permute, fuse an act, or
        # normalise differently: refuse to guess.
        for klass in cls.__mro__[: cls.__mro__.index(base)]:
            if "forward" in vars(klass):
                probed = _probed(module) if channel_dim == -1 and not entry.fused_act else None
                if probed is not None and probed.formula is not None:
                    return probed  # e.g. transformers' NemotronLayerNorm1P: layer(x) * (1 + w) + b
                reason = (
                    f"{cls.__qualname__} subclasses {base.__qualname__} but overrides forward, so its "
                    "layout is unknown; describe it with lightning_mrs.register_norm(...)"
                )
                return NormSpec("custom", channels, channel_dim, spatial, entry.fused_act, reason)
    return NormSpec(entry.kind, channels, channel_dim, spatial, entry.fused_act, reason)


def _probed(module: nn.Module) -> Optional[NormSpec]:
    """The spec of a module the table does not know but that looks like a last-dim norm
    (:func:`lightning_mrs.swap.probe.recognise`), ``None`` when it does not."""
    expected, eps = known_norm(module) or (None, None)
    found = recognise(module, eps=eps, expected=expected)
    if found is None:
        return None
    channels, formula, reason = found
    return NormSpec("probed", channels, -1, None, False, reason, formula)


def iter_norm_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module, NormSpec]]:
    """Every norm layer of ``model`` as ``(dotted_name, module, spec)``, in module order.

    A norm instance used in several places is yielded once, under its first name (the
    name ``model.named_modules()`` gives it). The root itself is yielded as ``""`` when it
    is a norm. Unsupported norms are yielded too; filter on ``spec.unsupported``.

    Example:
        >>> [(n, s.kind) for n, _, s in iter_norm_layers(nn.Sequential(nn.Linear(4, 4), MRSNorm(4)))]
        [('1', 'mrs')]
    """
    for name, module in model.named_modules():
        spec = norm_spec(module)
        if spec is not None:
            yield name, module, spec


# lightning-mrs's own layers: the swap's outputs must be recognised (a second swap is a no-op)
register_norm(MRSNorm, "mrs", -1)
register_norm(MRSNorm2d, "mrs", 1, spatial=lambda m: bool(m.spatial))
register_norm(LayerNorm2d, "layer2d", 1, spatial=False)
register_norm(RMSNorm2d, "rms2d", 1, spatial=lambda m: bool(m.spatial))
register_norm(OffsetRMSNorm, "rms", -1)
register_norm(RMSNormHalf, "rms-half", -1)
register_norm(MRSNormHalf, "mrs-half", -1)
register_norm(RMSNormHalfSafe, "rms-half-safe", -1)
register_norm(MRSNormHalfSafe, "mrs-half-safe", -1)
register_norm(DyT, "dyt", -1)
register_norm(DyT2d, "dyt", 1)
register_norm(Derf, "derf", -1)
register_norm(Derf2d, "derf", 1)
