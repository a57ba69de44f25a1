"""``swap_norms``: turn every norm layer of a model into MRSNorm (or RMSNorm / LayerNorm).

The swap first plans every layer (what it becomes, or why it is left alone), raises on any
problem under ``strict=True`` before touching the model, then rewrites the model in place.
See :class:`lightning_mrs.swap.SwapOptions` for the options; the QK-norms of attention
layers (``qk_norm``) are planned by :mod:`lightning_mrs.swap.attention`.
"""

from __future__ import annotations

import warnings
from fnmatch import fnmatchcase
from typing import Any, Optional, Union

from torch import nn

from lightning_mrs.swap.attention import plan_attention
from lightning_mrs.swap.build import Plan, build_replacement, plan_replacement
from lightning_mrs.swap.options import SwapOptions, check_model
from lightning_mrs.swap.registry import NormSpec, norm_spec
from lightning_mrs.swap.report import SwapReport, by_reason
from lightning_mrs.swap.rewire import rewire

__all__ = ["swap_norms"]


def _matches(module: nn.Module, names: list[str], selectors: tuple[Union[str, type], ...]) -> Optional[str]:
    """The first selector that picks ``module`` (by type) or one of its names (by pattern,
    the pattern matching the name or any ancestor's name)."""
    for sel in selectors:
        if isinstance(sel, type):
            if isinstance(module, sel):
                return sel.__qualname__
            continue
        for name in names:
            parts = name.split(".")
            if any(fnmatchcase(".".join(parts[:i]), sel) for i in range(1, len(parts) + 1)):
                return repr(sel)
    return None


def _deselected(opts: SwapOptions, module: nn.Module, names: list[str]) -> Optional[str]:
    """Why ``include``/``exclude`` leave ``module`` out, or ``None``."""
    hit = _matches(module, names, opts.exclude) if opts.exclude else None
    if hit is not None:
        return f"excluded by exclude={hit}"
    return "not matched by include" if opts.include and _matches(module, names, opts.include) is None else None


def swap_norms(model: nn.Module, target: Union[str, SwapOptions, None] = "mrs", **options: Any) -> SwapReport:
    """Replace the norm layers of ``model`` in place; return what was done.

    Norm layers are the registered classes (torch, timm, torchvision, lightning-mrs) and any
    other leaf that computes RMS or LayerNorm over the last dim, recognised by running it
    (:mod:`lightning_mrs.swap.probe`: every Hugging Face ``*RMSNorm``, Gemma's ``1 + w``
    included). Every norm is converted, already the target, excluded, or in ``report.skipped``
    with the reason; a swap that converts none of a model's norms warns.

    Args:
        model: any module (timm, torchvision, transformers, your own). Its root must not itself be a norm
            layer to replace: wrap it first, e.g. ``nn.Sequential(norm)``.
        target: ``"mrs"``, ``"rms"`` or ``"layer"``, ``None`` (keep the body's norms), or a
            whole :class:`SwapOptions`.
        **options: the other fields of :class:`SwapOptions` (``spatial``, ``include``,
            ``exclude``, ``init``, ``eps``, ``strict``, ``qk_norm``).

    Returns:
        A :class:`SwapReport`; ``print(report)`` gives the summary.

    Warns:
        UserWarning: the model has norm layers but none was converted (the reasons are listed).

    Raises:
        ValueError: a bad option, the root is a norm, or (``strict``) a norm cannot be swapped.
            The model is untouched when this is raised.
        TypeError: ``model`` is not an ``nn.Module``, an unknown option, or an option of the
            wrong type (``strict``, ``include``/``exclude``).

    Example:
        >>> import torchvision
        >>> model = torchvision.models.resnet18()
        >>> report = swap_norms(model, "mrs")
        >>> len(report.converted), report.changes["bn1"]
        (20, ('BatchNorm2d', 'MRSNorm2d(spatial=True)'))
        >>> vit = torchvision.models.VisionTransformer(32, 8, 1, 2, 16, 32)
        >>> sorted(swap_norms(vit, None, qk_norm="mrs").qk_added)  # MRS QK-norms, LayerNorms kept
        ['encoder.layers.encoder_layer_0.self_attention.k_norm', 'encoder.layers.encoder_layer_0.self_attention.q_norm']
    """
    check_model("swap_norms", model)
    opts = SwapOptions.of(target, "swap_norms", **options)
    target, spatial, strict = opts.target, opts.spatial, opts.strict
    report = SwapReport(target, options=opts)

    # 1. every dotted name of every module (a shared module has several)
    names: dict[int, list[str]] = {}  # id(module) -> all its dotted names, first one first
    for parent_name, parent in model.named_modules():
        for attr, child in vars(parent).get("_modules", {}).items():
            if child is not None:
                names.setdefault(id(child), []).append(f"{parent_name}.{attr}" if parent_name else attr)
    qk = plan_attention(model, opts, report, lambda module, qk_names: _deselected(opts, module, qk_names))

    # 2. plan: what each distinct norm becomes, or why it stays
    plans: dict[int, tuple[str, nn.Module, NormSpec, Plan]] = {}  # id(old norm) -> (first name, old, spec, plan)
    problems: list[str] = []
    found = 0  # norm layers of any kind, swappable or not
    for name, module in model.named_modules():
        spec = norm_spec(module)  # known classes, and any leaf that looks like a norm (probed)
        found += spec is not None
        kind = qk.target_of(module, target)  # a QK-norm follows qk_norm, the other norms target
        if spec is None or kind is None:
            continue
        all_names = names.get(id(module), [name]) if name else [""]
        others = [n for n in all_names if n != name]

        def skip(reason: str, user: bool = False) -> None:
            for n in [name, *others]:
                report.skipped[n] = reason
            if strict and not user:
                problems.append(f"{name or '<root>'} ({type(module).__qualname__}): {reason}")

        deselected = _deselected(opts, module, all_names)
        if deselected is not None:
            skip(deselected, user=True)
            continue
        if spec.unsupported:
            skip(spec.unsupported)
            continue
        plan = plan_replacement(module, spec, kind, spatial)
        if isinstance(plan, str):  # this target cannot replace this norm (an experimental half target)
            skip(plan)
            continue
        if plan is None:
            report.unchanged.append(name)
            continue
        if kind == "mrs" and spec.num_channels % 2:
            skip(
                f"odd channel count {spec.num_channels}: MRSNorm pairs adjacent channels; make the "
                "width even, keep this norm (exclude it), or use target='rms'/'layer'"
            )
            continue
        if module is model:
            raise ValueError(
                f"swap_norms: the model itself is a norm layer ({type(model).__qualname__}) and cannot "
                "be replaced in place; wrap it (nn.Sequential(norm)) or swap its parent module."
            )
        plans[id(module)] = (name, module, spec, plan)
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            report.notes.append(f"{name}: hooks registered on the old {type(module).__qualname__} were not moved")
        report.converted.append(name)
        for alias in others:
            report.aliases[alias] = name
    problems += qk.problems if strict else []
    if problems:
        raise ValueError(
            "swap_norms(strict=True): these norm layers cannot be swapped (nothing was changed):\n  "
            + "\n  ".join(problems)
        )

    # 3. build each replacement once, then point every reference at it (shared stays shared)
    new_modules = {key: build_replacement(m, spec, plan, opts.init, opts.eps) for key, (_, m, spec, plan) in plans.items()}
    new_modules.update(qk.replacements)  # attention layers rebuilt to take a QK-norm
    rewire(model, new_modules)
    qk.apply()
    for name, old, spec, plan in plans.values():
        report.changes[name] = (type(old).__qualname__, plan.label + ("+act" if spec.fused_act else ""))
        if spec.formula is not None:
            report.probed[name] = str(spec.formula)
    _say_if_nothing(model, report, found)
    return report


def _say_if_nothing(model: nn.Module, report: SwapReport, found: int) -> None:
    """Never silent: a model without norms says so; a swap that converted none of them warns."""
    if report.target is None:
        return
    if not found:
        report.notes.append(
            f"{type(model).__qualname__} has no norm layer (no known norm class, no leaf module named *Norm*, "
            "nothing the probe recognises as RMS or LayerNorm): nothing to swap"
        )
    elif not (report.converted or report.unchanged or report.qk_added) and report.skipped:
        lines = by_reason(report.skipped)
        reasons = "; ".join(line.strip() for line in lines[:3]) + ("; ..." if len(lines) > 3 else "")
        warnings.warn(
            f"swap_norms(target={report.target!r}) converted none of the {len(report.skipped)} norm layers of "
            f"{type(model).__qualname__}: {reasons}",
            UserWarning,
            stacklevel=3,
        )
