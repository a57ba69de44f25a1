"""``SwapOptions``: the options of a norm swap, shared by ``swap_norms`` and ``NormSwap``."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections import abc
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import nn

from lightning_mrs.ops.validation import positive_number

__all__ = ["Alpha0", "HALF_TARGETS", "POINTWISE_TARGETS", "QK_NORMS", "SWAP_TARGETS", "Selector", "SwapOptions", "check_bool", "check_model"]

#: experimental baselines computed in the input's dtype (lightning_mrs.swap.half): squares formed (overflow in
#: float16 from |x| = 256) and "-safe" (no intermediate overflow)
HALF_TARGETS = ("rms-half", "mrs-half", "rms-half-safe", "mrs-half-safe")
#: the norm-free point-wise baselines: DyT (Dynamic Tanh, :mod:`lightning_mrs.swap.dyt`) and Derf (Dynamic erf,
#: :mod:`lightning_mrs.swap.derf`); their initial scalars are options (``alpha0``; Derf's ``shift0``)
POINTWISE_TARGETS = ("dyt", "derf")
#: the values of ``target`` (``SwapOptions.target``, besides ``None``: keep the body's norms):
#: MRSNorm, the RMSNorm and LayerNorm baselines, the experimental half-precision ones, and the norm-free ones.
SWAP_TARGETS = ("mrs", "rms", "layer", *HALF_TARGETS, *POINTWISE_TARGETS)
_QK_KINDS = ("mrs", "rms", "layer")
#: the values of ``SwapOptions.qk_norm``: None (QK-norms that exist follow ``target``), True
#: (QK-norms of the target's kind everywhere), a kind (QK-norms of that kind), False (leave them).
QK_NORMS = (None, True, False, *_QK_KINDS)
_INITS = ("inherit", "ones", "calibrate")
_SPATIAL = ("auto", True, False)
#: what ``alpha0`` (and ``shift0``) take: DyT's or Derf's initial alpha for every layer, or dotted-name patterns ->
#: alpha (the first pattern that picks a layer gives its value), or None (the paper's default, 0.5)
Alpha0 = Union[float, Mapping[str, float], Iterable[tuple[str, float]], None]
#: the per-layer initial scalars: option -> (the targets that take it, what it is, its check, the check in words,
#: an example mapping)
INITIAL_SCALARS = {
    "alpha0": (POINTWISE_TARGETS, "the initial alpha of DyT and Derf layers",
               positive_number, "a finite float > 0", "{'*.input_layernorm': 0.8, '*': 0.2}"),
    "shift0": (("derf",), "the initial shift of Derf layers",
               lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v),
               "a finite float", "{'*.input_layernorm': 0.1, '*': 0.0}"),
}
#: what ``include``/``exclude`` take: a name pattern, a class, a list of both, or None
#: (docs/swap.md#include-and-exclude-patterns).
Selector = Union[str, type, Iterable[Union[str, type]], None]


def check_bool(owner: str, name: str, value: Any) -> None:
    """Raise a ``TypeError`` naming ``owner`` unless ``value`` is a bool (``"yes"`` or ``1``
    would otherwise be stored and read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name}={value!r} is not valid; choose True or False.")


def check_model(owner: str, model: Any) -> None:
    """Raise a ``TypeError`` naming ``owner`` unless ``model`` is an ``nn.Module`` (a model
    name is the usual mistake: build the model first; an ``ExportedProgram``: swap before exporting)."""
    if isinstance(model, torch.export.ExportedProgram):  # a program, not a module: its layers are aten ops
        raise TypeError(
            f"{owner}: model must be a torch.nn.Module, got a torch.export ExportedProgram, whose layers export "
            "flattened into aten ops, so no swap can replace its norms; pass the eager model (swap it first, then "
            "export it: torch.export.export(swapped, args))."
        )
    if not isinstance(model, nn.Module):
        example = f"timm.create_model({model!r})" if isinstance(model, str) else 'timm.create_model("resnet18")'
        shown = repr(model) if len(repr(model)) <= 80 else repr(model)[:77] + "..."  # e.g. a whole state_dict
        raise TypeError(
            f"{owner}: model must be a torch.nn.Module, got {type(model).__name__} ({shown}); build the model "
            f"first and pass it, e.g. {example}."
        )


def _check_names(owner: str, options: Iterable[str]) -> None:
    """Raise a ``TypeError`` naming ``owner`` for keywords that are not fields of ``SwapOptions``,
    listing the valid ones and suggesting the closest."""
    fields = [f.name for f in dataclasses.fields(SwapOptions)]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        close = [match[0] for name in unknown if (match := difflib.get_close_matches(name, fields, n=1))]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise TypeError(f"{owner}: unknown option(s) {unknown}{hint}; valid options: {fields}.")


def _selectors(value: Selector, option: str) -> tuple[Union[str, type], ...]:
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        items: tuple[Any, ...] = (value,)
    elif isinstance(value, abc.Iterable):
        items = tuple(value)
    else:
        raise TypeError(
            f"SwapOptions: {option}={value!r} ({type(value).__name__}) is not valid; pass a dotted-name pattern "
            "(e.g. 'head.*'), a module type (e.g. nn.BatchNorm2d), or a list of them."
        )
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"SwapOptions({option}=...): each entry must be a module type (e.g. nn.BatchNorm2d) "
                f"or a dotted-name pattern (e.g. 'head.*'), got {item!r}."
            )
    return items


def _initial_scalar(option: str, value: Alpha0, target: Optional[str]) -> Union[float, tuple[tuple[str, float], ...], None]:
    """``alpha0``/``shift0`` (:data:`INITIAL_SCALARS`) checked: ``None``, a float, or a tuple of ``(pattern, value)``
    pairs."""
    if value is None:
        return None
    targets, what, valid, words, example = INITIAL_SCALARS[option]
    if target not in targets:
        ask = " or ".join(f"target={t!r}" for t in targets)
        raise ValueError(f"SwapOptions: {option}={value!r} is {what}, but target={target!r}; use {ask}, or drop {option}.")
    if valid(value):
        return float(value)
    fix = f"pass {words}, or a mapping of dotted-name patterns to such floats, e.g. {example}"
    if isinstance(value, (str, bytes)) or not isinstance(value, abc.Iterable):
        raise ValueError(f"SwapOptions: {option}={value!r} is not valid; {fix}.")
    pairs = tuple(value.items()) if isinstance(value, abc.Mapping) else tuple(value)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and valid(pair[1])):
            raise ValueError(f"SwapOptions: {option} entry {pair!r} is not valid; {fix}.")
    if not pairs:
        raise ValueError(f"SwapOptions: {option}={value!r} is empty; {fix}.")
    return tuple((pattern, float(v)) for pattern, v in pairs)


@dataclass(frozen=True)
class SwapOptions:
    """What a norm swap does (see :func:`lightning_mrs.swap_norms`).

    Attributes:
        target: ``"mrs"`` (MRSNorm / MRSNorm2d), or the baselines ``"rms"`` (nn.RMSNorm /
            RMSNorm2d) and ``"layer"`` (nn.LayerNorm / LayerNorm2d / GroupNorm(1, C)), or
            ``None``: the body's norms stay as they are (vary the QK-norm alone, ``qk_norm``).
            Experimental: ``"rms-half"``/``"mrs-half"`` compute in the input's dtype with the squares
            formed (the paper's half-precision setting), ``"rms-half-safe"``/``"mrs-half-safe"`` in the
            input's dtype without intermediate overflow (:mod:`lightning_mrs.swap.half`; channels-last
            norms only). ``"dyt"``: Dynamic Tanh, ``w * tanh(alpha * x) + b`` (``DyT`` channels-last,
            ``DyT2d`` channels-first; :mod:`lightning_mrs.swap.dyt`), the norm-free baseline; ``"derf"``:
            Dynamic erf, ``w * erf(alpha * x + s) + b`` (``Derf``/``Derf2d``; :mod:`lightning_mrs.swap.derf`).
        qk_norm: the per-head norm on the queries and keys of attention layers (QK-norm;
            see :mod:`lightning_mrs.swap.attention`). ``None`` (default): a QK-norm the model
            already has is a norm like any other and follows ``target``; none is added.
            ``True``: every attention layer gets a QK-norm of the target's kind (added where
            it has none, swapped where it has one). ``"mrs"``/``"rms"``/``"layer"``: the same,
            of that kind whatever ``target`` is. ``False``: QK-norms are left alone and none
            is added. ``target=None`` with ``qk_norm`` ``None``/``False`` asks for nothing:
            the swap is a no-op whose report says so (a sweep's "keep the model" arm).
            An added QK-norm has unit weights and ``eps`` (``1e-6`` when ``eps`` is None);
            ``include``/``exclude`` select it by the names ``<attention layer>.q_norm``/``.k_norm``.
        spatial: channels-first sources only. ``"auto"``: BatchNorm/GroupNorm/InstanceNorm
            become per-sample (one scale per sample over all positions), LayerNorm2d/RmsNorm2d
            stay per-position; ``True``/``False`` force per-sample / per-position.
        include: only swap norms of these types or whose whole dotted name (or an ancestor's)
            matches one of these fnmatch patterns; others are skipped and reported. On a Qwen3,
            ``"model.layers.0"`` picks the first block's norms (an ancestor's whole name),
            ``"*.q_norm"`` every query norm (a glob); ``"q_norm"`` (a part of a name) picks nothing.
            An entry that picks no module raises (:mod:`lightning_mrs.swap.selectors`).
        exclude: never swap these (wins over ``include``); the same matching.
        init: ``"inherit"``: new weights from the old ones (an MRS phasor weight is the mean of
            its two channels' weights, so zero-init residual branches stay zero; a bias and
            BatchNorm running statistics are dropped where the target has none); ``"ones"``:
            fresh weights; ``"calibrate"``: the inherited weights, then fitted by least squares
            on ``swap_norms(..., calibration=batch)`` so that each new layer's output matches the
            old one (:mod:`lightning_mrs.swap.calibrate`).
        eps: the new layers' eps; ``None`` keeps each old layer's eps.
        alpha0: ``target="dyt"`` or ``"derf"`` only: the initial ``alpha`` of the new DyT (Derf) layers.
            ``None``: the paper's default, 0.5; a float: every layer; a mapping (or pairs) of dotted-name patterns to values,
            matched as ``include`` matches: each layer takes the value of the first pattern that picks it,
            0.5 where none does, and a pattern that picks no layer raises. The paper's LLaMA 2 7B values
            on a transformers Llama: ``{"*.input_layernorm": 0.8, "*": 0.2}`` (0.8 in front of attention,
            0.2 elsewhere; ``lightning_mrs.swap.dyt.LLAMA_ALPHA0``).
        shift0: ``target="derf"`` only: the initial shift ``s`` of the new Derf layers. ``None``: the paper's
            default, 0; a finite float (any sign) or patterns, as ``alpha0``.
        strict: raise, listing every layer concerned, instead of skipping a norm for any
            reason other than ``include``/``exclude``.

    Example:
        >>> SwapOptions("rms", exclude="head").exclude
        ('head',)
        >>> SwapOptions(None, qk_norm="mrs").qk_kind  # MRS QK-norms, body norms kept
        'mrs'
    """

    target: Optional[str] = "mrs"
    spatial: Union[str, bool] = "auto"
    include: Selector = None
    exclude: Selector = None
    init: str = "inherit"
    eps: Optional[float] = None
    strict: bool = False
    qk_norm: Union[bool, str, None] = None
    alpha0: Alpha0 = None
    shift0: Alpha0 = None

    def __new__(cls, *args: Any, **options: Any) -> "SwapOptions":
        _check_names("SwapOptions", options)  # before the dataclass __init__'s bare TypeError
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.target is not None and self.target not in SWAP_TARGETS:
            raise ValueError(
                f"SwapOptions: target={self.target!r} is not valid; choose one of {list(SWAP_TARGETS)}, "
                "or None to keep the body's norms."
            )
        qk = self.qk_norm
        if not any(qk is v for v in (None, True, False)) and (not isinstance(qk, str) or qk not in _QK_KINDS):
            raise ValueError(f"SwapOptions: qk_norm={qk!r} is not valid; choose one of {list(QK_NORMS)}.")
        if qk is True and self.target not in _QK_KINDS:
            raise ValueError(
                f"SwapOptions: qk_norm=True asks for QK-norms of the target's kind, but target={self.target!r}; "
                f"name the kind instead, e.g. qk_norm='mrs' (one of {list(_QK_KINDS)})."
            )
        if not any(self.spatial is s for s in _SPATIAL) and self.spatial != "auto":
            raise ValueError(f"SwapOptions: spatial={self.spatial!r} is not valid; choose one of {list(_SPATIAL)}.")
        if self.init not in _INITS:
            raise ValueError(f"SwapOptions: init={self.init!r} is not valid; choose one of {list(_INITS)}.")
        check_bool("SwapOptions", "strict", self.strict)
        eps = self.eps
        if eps is not None and not positive_number(eps):
            raise ValueError(f"SwapOptions: eps={eps!r} is not valid; choose None (keep each layer's eps) or a "
                             "finite float > 0.")
        for option in INITIAL_SCALARS:
            object.__setattr__(self, option, _initial_scalar(option, getattr(self, option), self.target))
        object.__setattr__(self, "include", _selectors(self.include, "include"))
        object.__setattr__(self, "exclude", _selectors(self.exclude, "exclude"))

    @classmethod
    def of(cls, target: Union[str, "SwapOptions", None], caller: str, **options: Any) -> "SwapOptions":
        """``target`` as options: a ``SwapOptions`` (with ``options`` replacing fields) or a
        target name with the other fields as keywords.

        Raises:
            TypeError: an unknown keyword, listing the valid ones.
        """
        _check_names(caller, options)
        if isinstance(target, SwapOptions):
            return dataclasses.replace(target, **options)
        return cls(target, **options)

    @property
    def qk_kind(self) -> Optional[str]:
        """The kind of QK-norm every attention layer gets (``None``: none is added)."""
        if self.qk_norm is True:
            return self.target
        return self.qk_norm if isinstance(self.qk_norm, str) else None

    def describe(self) -> str:
        """The options that differ from the defaults, as keyword arguments."""
        default = SwapOptions()
        parts = [f"target={self.target!r}"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "target" and value != getattr(default, f.name):
                parts.append(f"{f.name}={value!r}")
        return ", ".join(parts)
