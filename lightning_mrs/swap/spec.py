"""A swapped model's norm layers as plain data, and the way to rebuild them on a fresh model.

A checkpoint must say what a swap *built*, not how it was asked for: ``spatial="auto"`` and
``spatial=True`` build identical layers from a BatchNorm, and a model swapped before
training (a second ``fit``) has nothing left to convert but is every bit as swapped.
:func:`describe_layers` lists every norm layer of the target's kind (``mrs``; ``rms``;
``layer``) with what decides its computation: kind, layout, per-sample or per-position,
eps; and every attention QK-norm (``<attention>.q_norm``/``.k_norm``), whatever its kind,
marked ``"qk": True`` (a QK-norm may have been *added*: a fresh model has none there); a layer
that replaced a probed norm (a transformers ``*RMSNorm``, :mod:`lightning_mrs.swap.probe`) has
``"from"``: the old class and the formula the probe found. :func:`rebuild` applies such a list to a freshly built model of the same class, and
:func:`differences` says, layer by layer, how two lists differ.

Example:
    >>> from torch import nn
    >>> from lightning_mrs import swap_norms
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    >>> _ = swap_norms(model, "mrs")
    >>> describe_layers(model, "mrs")
    {'1': {'kind': 'mrs', 'channel_dim': 1, 'spatial': True, 'eps': 1e-05}}
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Optional

from torch import nn

from lightning_mrs.swap.attention_info import is_qk_name
from lightning_mrs.swap.engine import swap_norms
from lightning_mrs.swap.layer_record import LayerRecord, differences, format_record, layer_record
from lightning_mrs.swap.options import HALF_TARGETS, QK_NORMS, SWAP_TARGETS
from lightning_mrs.swap.registry import NormSpec, iter_norm_layers, norm_spec

__all__ = ["LayerRecord", "describe_layers", "differences", "format_record", "is_qk_name", "rebuild", "rebuild_v1"]

#: the swap target that builds a layer of each recorded kind
_TARGET_OF_KIND = {"mrs": "mrs", "rms": "rms", "rms2d": "rms", "layer": "layer", "layer2d": "layer", "group": "layer",
                   "dyt": "dyt", "derf": "derf", **{t: t for t in HALF_TARGETS}}


def _of_target(module: nn.Module, spec: NormSpec, target: str) -> bool:
    """A layer ``target`` builds (a GroupNorm only with one group: LayerNorm over C, H, W)."""
    return _TARGET_OF_KIND.get(spec.kind) == target and (spec.kind != "group" or getattr(module, "num_groups", 0) == 1)


def describe_layers(model: nn.Module, target: Optional[str]) -> dict[str, LayerRecord]:
    """Every norm layer of ``model`` of ``target``'s kind, and every QK-norm: dotted name ->
    :data:`LayerRecord`.

    The layers a swap to ``target`` built are of that kind, and so are the ones that already
    were (a model swapped before, or built with MRSNorm): all of them are listed. QK-norms are
    listed whatever their kind, with ``"qk": True``.

    Args:
        model: any module.
        target: one of ``SWAP_TARGETS`` (``"mrs"``, ``"rms"``, ``"layer"``...), or ``None`` (QK-norms only: a swap that
            kept the body's norms).

    Returns:
        ``{name: {"kind", "channel_dim", "spatial", "eps"}}`` in module order; a shared
        instance under its first name; a fused norm+act layer's norm as ``<name>.norm``.

    Raises:
        ValueError: an unknown ``target``.

    Example:
        >>> from torch import nn
        >>> from lightning_mrs import MRSNorm
        >>> describe_layers(nn.Sequential(nn.Linear(4, 6), MRSNorm(6, eps=1e-6)), "mrs")
        {'1': {'kind': 'mrs', 'channel_dim': -1, 'spatial': None, 'eps': 1e-06}}
    """
    if target is not None and target not in SWAP_TARGETS:
        raise ValueError(
            f"describe_layers: target={target!r} is not valid; choose one of {list(SWAP_TARGETS)} or None."
        )
    records: dict[str, LayerRecord] = {}
    for name, module, spec in iter_norm_layers(model):
        if spec.unsupported is not None:
            continue
        qk = is_qk_name(name)
        if qk or (target is not None and _of_target(module, spec, target)):
            records[name] = layer_record(name, module, spec)
    return records


def _literal(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself (ModuleDict keys may hold ``[``, ``*``...)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def rebuild(model: nn.Module, target: Optional[str], records: dict[str, LayerRecord]) -> None:
    """Swap a freshly built ``model`` so that its ``target``-kind norms are ``records``.

    The new layers get fresh weights (``init="ones"``): load the trained ones afterwards. A
    record named ``x.norm`` may come from a fused norm+act layer ``x`` (timm's
    ``BatchNormAct2d``), which the swap turns into ``NormAct(norm, drop, act)``. QK-norms are
    added (or swapped) where the records have them, with ``swap_norms(model, None,
    qk_norm=kind)`` limited to their names.

    Args:
        model: a freshly built model of the class that was swapped.
        target: the target of the recorded swap, or ``None``: each record's kind says what it
            became (a transformers config's record, :mod:`lightning_mrs.swap.hf_format`).
        records: what :func:`describe_layers` gave for the swapped model.

    Raises:
        ValueError: the model cannot be made to match (another architecture), listing the
            layers that differ.

    Example:
        >>> from torch import nn
        >>> from lightning_mrs import swap_norms
        >>> trained = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
        >>> _ = swap_norms(trained, "mrs", spatial=False)
        >>> fresh = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
        >>> rebuild(fresh, "mrs", describe_layers(trained, "mrs"))
        >>> fresh[1]
        MRSNorm2d(8, eps=1e-05, affine=True, spatial=False)
    """
    modules = dict(model.named_modules())
    groups: dict[tuple[str, Any, Optional[float]], list[str]] = {}
    qk_groups: dict[tuple[str, Optional[float]], list[str]] = {}
    for name, record in records.items():
        kind = _TARGET_OF_KIND.get(record["kind"])
        if record.get("qk"):
            # kind None: the layer's own QK-norm, left as it was (a fresh model has it); a layer this
            # model lacks: another model, which the comparison below reports
            if kind is not None and name.rpartition(".")[0] in modules:
                if kind in QK_NORMS:
                    qk_groups.setdefault((kind, record["eps"]), []).append(_literal(name))
                else:  # no QK kind (DyT, Derf, a half norm): the model's own QK-norm, swapped as it was, with the body
                    groups.setdefault((kind, "auto", record["eps"]), []).append(_literal(name))
            continue
        if name not in modules and name.endswith(".norm") and name[: -len(".norm")] in modules:
            name = name[: -len(".norm")]  # the fused norm+act layer this norm came from
        if kind is None:
            raise ValueError(f"{name}: a recorded {record['kind']!r} layer is not one a swap builds")
        if name not in modules:  # another model: swap what matches, the comparison below lists the rest
            continue
        spatial = record["spatial"] if record["channel_dim"] == 1 and record["spatial"] is not None else "auto"
        groups.setdefault((target or kind, spatial, record["eps"]), []).append(_literal(name))
    with warnings.catch_warnings():  # a model that cannot match gets the error below, not a warning too
        warnings.simplefilter("ignore", UserWarning)
        for (kind, spatial, eps), names in groups.items():
            swap_norms(model, kind, spatial=spatial, eps=eps, include=names, init="ones")
        for (kind, eps), names in qk_groups.items():
            swap_norms(model, None, qk_norm=kind, eps=eps, include=names, init="ones")
    if target is not None:
        got = describe_layers(model, target)
    else:  # a record of several kinds (a transformers config's): the recorded layers themselves
        modules = dict(model.named_modules())
        got = {}
        for name in records:
            spec = norm_spec(modules[name]) if name in modules else None
            if spec is not None:
                got[name] = layer_record(name, modules[name], spec)
    if got != records:
        raise ValueError(
            "the model does not match the recorded swap:\n  "
            + "\n  ".join(differences(records, got, labels=("recorded", "this model")))
            + "\nPass a freshly built model of the class that was trained."
        )


def rebuild_v1(model: nn.Module, record: dict[str, Any]) -> None:
    """Swap a freshly built ``model`` as a lightning-mrs 0.1 NormSwap record says.

    Version 1 recorded the swap's options and the names it converted
    (``{"version": 1, "target", "spatial", "eps", "converted": [names]}``): the same swap,
    limited to those names, rebuilds the layers.

    Raises:
        ValueError: the record names no layer (0.1 recorded nothing for a model swapped before
            its fit), or a layer the model does not have as a norm to swap.

    Example:
        >>> from torch import nn
        >>> fresh = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.BatchNorm2d(8))
        >>> rebuild_v1(fresh, {"version": 1, "target": "mrs", "spatial": "auto", "eps": None, "converted": ["1"]})
        >>> [type(m).__name__ for m in fresh]
        ['Conv2d', 'MRSNorm2d', 'BatchNorm2d']
    """
    target, spatial, eps = record.get("target"), record.get("spatial", "auto"), record.get("eps")
    names = list(record.get("converted") or ())
    if not names:
        raise ValueError(
            "this lightning-mrs 0.1 record lists no converted layers (0.1 recorded none for a model swapped before "
            f"its fit). Call lightning_mrs.swap_norms(model, {target!r}, spatial={spatial!r}, eps={eps!r}) with the "
            "training options yourself, then model.load_state_dict(checkpoint['state_dict'])."
        )
    present = {n for n, _ in model.named_modules()}  # a name the model lacks is missing below, not a bad pattern
    include = [_literal(n) for n in names if n in present]
    converted = swap_norms(model, target, spatial=spatial, eps=eps, include=include, init="ones").converted if include else []
    missing = [name for name in names if name not in converted]
    if missing:
        raise ValueError(
            f"the record converted {missing[:5]}, which this model does not have as norm layers to swap. "
            "Pass a freshly built model of the class that was trained."
        )
