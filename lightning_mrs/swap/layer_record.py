"""One norm layer as plain data (a checkpoint's or a ``config.json``'s record), and how two differ.

:func:`layer_record` says what decides a layer's computation: its kind, layout (channels-first or
-last; per sample or per position), eps; ``"qk": True`` for an attention QK-norm; ``"from"``: the
class and formula of the probed norm it replaced (a transformers ``*RMSNorm``); ``"offset"`` for an
:class:`~lightning_mrs.swap.layers.OffsetRMSNorm`. :mod:`lightning_mrs.swap.spec` lists a model's
records and rebuilds them; :mod:`lightning_mrs.swap.hf_format` writes them into the config a
transformers model saves.

Example:
    >>> from lightning_mrs import MRSNorm, norm_spec
    >>> norm = MRSNorm(6, eps=1e-6)
    >>> layer_record("1", norm, norm_spec(norm))
    {'kind': 'mrs', 'channel_dim': -1, 'spatial': None, 'eps': 1e-06}
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_mrs.swap.attention_info import is_qk_name
from lightning_mrs.swap.layers import OffsetRMSNorm
from lightning_mrs.swap.registry import NormSpec

__all__ = ["LayerRecord", "differences", "format_record", "layer_record"]

LayerRecord = dict[str, Any]  # {"kind", "channel_dim", "spatial", "eps"[, "qk"][, "from"][, "offset"]}: JSON-friendly


def layer_record(name: str, module: nn.Module, spec: NormSpec) -> LayerRecord:
    """What decides the computation of the norm ``module`` (at ``name``), as JSON-friendly data."""
    eps = getattr(module, "eps", None)
    record: LayerRecord = {
        "kind": spec.kind,
        "channel_dim": spec.channel_dim,
        "spatial": spec.spatial,
        "eps": float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None,
    }
    if is_qk_name(name):
        record["qk"] = True
    source = getattr(module, "swapped_from", None)
    if isinstance(source, str):  # a probed layer: what it computed ("GemmaRMSNorm: rms(x) * (1 + w), ...")
        record["from"] = source
    if isinstance(module, OffsetRMSNorm):
        record["offset"] = module.offset
    return record


def format_record(record: Optional[LayerRecord]) -> str:
    """A record as a short label; ``None`` (no norm of the target's kind there) as ``not swapped``.

    Example:
        >>> format_record({"kind": "mrs", "channel_dim": 1, "spatial": True, "eps": 1e-5})
        'mrs(channels-first, per sample, eps=1e-05)'
    """
    if record is None:
        return "not swapped"
    layout = "channels-last" if record.get("channel_dim") == -1 else "channels-first"
    if record.get("spatial") is not None:
        layout += ", per sample" if record["spatial"] else ", per position"
    eps = record.get("eps")
    label = f"{record.get('kind')}({layout}, eps={'default' if eps is None else format(eps, 'g')})"
    return f"QK-norm {label}" if record.get("qk") else label


def differences(
    expected: dict[str, LayerRecord],
    got: dict[str, LayerRecord],
    labels: tuple[str, str] = ("checkpoint", "this run"),
    limit: int = 5,
) -> list[str]:
    """One line per layer whose records differ, naming both descriptions (at most ``limit``).

    Example:
        >>> a = {"1": {"kind": "mrs", "channel_dim": 1, "spatial": True, "eps": 1e-5}}
        >>> differences(a, {"1": dict(a["1"], spatial=False)}, labels=("old", "new"))
        ['1: old mrs(channels-first, per sample, eps=1e-05), new mrs(channels-first, per position, eps=1e-05)']
    """
    lines = []
    for name in sorted(set(expected) | set(got)):
        if expected.get(name) != got.get(name):
            lines.append(
                f"{name or '<root>'}: {labels[0]} {format_record(expected.get(name))}, "
                f"{labels[1]} {format_record(got.get(name))}"
            )
    shown = lines[:limit]
    if len(lines) > limit:
        shown.append(f"... and {len(lines) - limit} more")
    return shown
