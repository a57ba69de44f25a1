"""A swapped model's norm layers as plain data, and the way to rebuild them on a fresh model.

A checkpoint must say what a swap *built*, not how it was asked for: ``spatial="auto"`` and
``spatial=True`` build identical layers from a BatchNorm, and a model swapped before
training (a second ``fit``) has nothing left to convert but is every bit as swapped.
:func:`describe_layers` lists every norm layer of the target's kind (``mrs``; ``rms``;
``layer``) with what decides its computation: kind, layout, per-sample or per-position,
eps. :func:`rebuild` applies such a list to a freshly built model of the same class.

Example:
    >>> from torch import nn
    >>> from lightning_mrs import swap_norms
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    >>> _ = swap_norms(model, "mrs")
    >>> describe_layers(model, "mrs")
    {'1': {'kind': 'mrs', 'channel_dim': 1, 'spatial': True, 'eps': 1e-05}}
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_mrs.swap.engine import swap_norms
from lightning_mrs.swap.registry import NormSpec, iter_norm_layers

__all__ = ["LayerRecord", "describe_layers", "differences", "format_record", "rebuild"]

LayerRecord = dict[str, Any]  # {"kind", "channel_dim", "spatial", "eps"}: JSON-friendly


def _of_target(module: nn.Module, spec: NormSpec, target: str) -> bool:
    if target == "mrs":
        return spec.kind == "mrs"
    if target == "rms":
        return spec.kind in ("rms", "rms2d")
    return spec.kind in ("layer", "layer2d") or (spec.kind == "group" and getattr(module, "num_groups", 0) == 1)


def describe_layers(model: nn.Module, target: str) -> dict[str, LayerRecord]:
    """Every norm layer of ``model`` of ``target``'s kind: dotted name -> :data:`LayerRecord`."""
    records: dict[str, LayerRecord] = {}
    for name, module, spec in iter_norm_layers(model):
        if spec.unsupported is None and _of_target(module, spec, target):
            eps = getattr(module, "eps", None)
            records[name] = {
                "kind": spec.kind,
                "channel_dim": spec.channel_dim,
                "spatial": spec.spatial,
                "eps": float(eps) if isinstance(eps, (int, float)) else None,
            }
    return records


def format_record(record: Optional[LayerRecord]) -> str:
    """A record as a short label, e.g. ``mrs(channels-first, per sample, eps=1e-05)``."""
    if record is None:
        return "no such norm"
    layout = "channels-last" if record["channel_dim"] == -1 else "channels-first"
    if record["spatial"] is not None:
        layout += ", per sample" if record["spatial"] else ", per position"
    return f"{record['kind']}({layout}, eps={record['eps']:g})"


def differences(expected: dict[str, LayerRecord], got: dict[str, LayerRecord], limit: int = 5) -> list[str]:
    """Human-readable lines for the layers whose records differ (at most ``limit``)."""
    lines = []
    for name in sorted(set(expected) | set(got)):
        if expected.get(name) != got.get(name):
            lines.append(f"{name or '<root>'}: {format_record(expected.get(name))} vs {format_record(got.get(name))}")
    shown = lines[:limit]
    if len(lines) > limit:
        shown.append(f"... and {len(lines) - limit} more")
    return shown


def rebuild(model: nn.Module, target: str, records: dict[str, LayerRecord]) -> None:
    """Swap a freshly built ``model`` so that its ``target``-kind norms are ``records``.

    A record named ``x.norm`` may come from a fused norm+act layer ``x`` (timm's
    ``BatchNormAct2d``), which the swap turns into ``NormAct(norm, drop, act)``.

    Raises:
        ValueError: the model cannot be made to match (another architecture), listing the
            layers that differ.
    """
    modules = dict(model.named_modules())
    groups: dict[tuple[Any, Optional[float]], list[str]] = {}
    for name, record in records.items():
        if name not in modules and name.endswith(".norm") and name[: -len(".norm")] in modules:
            name = name[: -len(".norm")]  # the fused norm+act layer this norm came from
        spatial = record["spatial"] if record["channel_dim"] == 1 else "auto"
        groups.setdefault((spatial, record["eps"]), []).append(name)
    for (spatial, eps), names in groups.items():
        swap_norms(model, target, spatial=spatial, eps=eps, include=names, init="ones")
    got = describe_layers(model, target)
    if got != records:
        raise ValueError(
            "the model does not match the recorded swap (recorded vs this model):\n  "
            + "\n  ".join(differences(records, got))
            + "\nPass a freshly built model of the class that was trained."
        )
