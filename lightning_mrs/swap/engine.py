"""``swap_norms``: turn every norm layer of a model into MRSNorm (or RMSNorm / LayerNorm).

The swap first plans every layer (what it becomes, or why it is left alone), raises on any
problem under ``strict=True`` before touching the model, then rewrites the model in place.
See :class:`lightning_mrs.swap.SwapOptions` for the options; the QK-norms of attention
layers (``qk_norm``) are planned by :mod:`lightning_mrs.swap.attention`.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

from torch import nn

from lightning_mrs.swap.attention import plan_attention
from lightning_mrs.swap.build import Plan, build_replacement, offloaded, plan_replacement
from lightning_mrs.swap.calibrate import Calibration, calibrate, check_runs
from lightning_mrs.swap.fx_calls import refuse_hidden_norms
from lightning_mrs.swap.options import SwapOptions, check_model
from lightning_mrs.swap.registry import NormSpec, norm_spec
from lightning_mrs.swap.report import SwapReport, by_reason, check_report
from lightning_mrs.swap.rewire import rewire
from lightning_mrs.swap.selectors import check_selectors, deselected, initial_scalars

__all__ = ["swap_norms"]


def swap_norms(model: nn.Module, target: Union[str, SwapOptions, None] = "mrs", *,
               calibration: Optional[Calibration] = None, **options: Any) -> SwapReport:
    """Replace the norm layers of ``model`` in place; return what was done.

    Norm layers are the registered classes (torch, timm, torchvision, lightning-mrs) and any
    other leaf that computes RMS or LayerNorm over the last dim, recognised by running it
    (:mod:`lightning_mrs.swap.probe`: every Hugging Face ``*RMSNorm``, Gemma's ``1 + w``
    included). Every norm is converted, already the target, excluded, or in ``report.skipped``
    with the reason; a swap that converts none of a model's norms warns.

    Args:
        model: any module (timm, torchvision, transformers, your own). Its root must not itself be a norm
            layer to replace: wrap it first, e.g. ``nn.Sequential(norm)``.
        target: ``"mrs"``, ``"rms"``, ``"layer"``, ``"dyt"`` (the others: ``SWAP_TARGETS``), ``None``
            (keep the body's norms), or a whole :class:`SwapOptions`.
        calibration: ``init="calibrate"`` only: data to fit the new weights on (a tensor passed
            as ``model(batch)``, a dict as ``model(**batch)``, or a callable that runs the
            model; :mod:`lightning_mrs.swap.calibrate`).
        **options: the other fields of :class:`SwapOptions` (``spatial``, ``include``,
            ``exclude``, ``init``, ``eps``, ``strict``, ``qk_norm``, ``alpha0``).

    Returns:
        A :class:`SwapReport`; ``print(report)`` gives the summary.

    Warns:
        UserWarning: the model has norm layers but none was converted (the reasons are listed).

    Raises:
        ValueError: a bad option, the root is a norm, a graph computes norms inline (a ``torch.fx`` graph's
            norm calls or arithmetic, a ``torch.export`` module, TorchScript; swap before tracing:
            :mod:`lightning_mrs.swap.fx_calls`), or (``strict``) a norm cannot be swapped. The model is
            untouched when this is raised.
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
    if (opts.init == "calibrate") != (calibration is not None):
        raise ValueError("swap_norms: init='calibrate' needs calibration= (a batch the model runs on, a dict of its "
                         "inputs, or a callable that runs it)" if calibration is None else
                         f"swap_norms: calibration= is only used with init='calibrate' (init={opts.init!r})")

    target, spatial, strict = opts.target, opts.spatial, opts.strict
    if target is not None or opts.qk_kind is not None:  # a graph's inlined norms (fx, export, TorchScript): no layer
        refuse_hidden_norms("swap_norms", model, body=target is not None)
    report = SwapReport(target, options=opts)

    # 1. every dotted name of every module (a shared module has several)
    names: dict[int, list[str]] = {}  # id(module) -> all its dotted names, first one first
    for parent_name, parent in model.named_modules():
        for attr, child in vars(parent).get("_modules", {}).items():
            if child is not None:
                names.setdefault(id(child), []).append(f"{parent_name}.{attr}" if parent_name else attr)
    qk_names: list[str] = []  # the names of QK-norms the swap would add: include/exclude may pick them

    def qk_deselected(module: nn.Module, added: list[str]) -> Optional[str]:
        qk_names.extend(added)
        return deselected(opts, module, added)

    qk = plan_attention(model, opts, report, qk_deselected)
    check_selectors("swap_norms", opts, model, [n for ns in names.values() for n in ns] + qk_names)

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

        why = deselected(opts, module, all_names)
        if why is not None:
            skip(why, user=True)
            continue
        if spec.unsupported:
            skip(spec.unsupported)
            continue
        if offloaded(module):
            skip("accelerate offloads its weights (they are loaded for each forward), so a replacement cannot take "
                 "them; swap before dispatch_model / device_map, e.g. lightning_mrs.from_pretrained(path, "
                 "device_map=...)")
            continue
        plan = plan_replacement(module, spec, kind, spatial, initial_scalars(opts, module, all_names))
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

    if calibration is not None:
        check_runs(model, calibration)  # data the model cannot run: refused while the model is untouched

    # 3. build each replacement once, then point every reference at it (shared stays shared);
    # the attention layers are rebuilt or hooked afterwards, from the modules the model holds then
    new_modules = {key: build_replacement(m, spec, plan, opts.init, opts.eps) for key, (_, m, spec, plan) in plans.items()}
    rewire(model, new_modules)
    qk.apply(model)
    for name, old, spec, plan in plans.values():
        report.changes[name] = (type(old).__qualname__, plan.label + ("+act" if spec.fused_act else ""))
        if spec.formula is not None:
            report.probed[name] = str(spec.formula)
    check_report(model, report, {name: new_modules[key] for key, (name, *_) in plans.items()})
    if calibration is not None:
        _calibrate(model, report, [(name, old, new_modules[key], spec) for key, (name, old, spec, _) in plans.items()],
                   calibration)
    _say_if_nothing(model, report, found)
    return report


def _calibrate(model: nn.Module, report: SwapReport, built: list[tuple[str, nn.Module, nn.Module, NormSpec]],
               calibration: Calibration) -> None:
    """Fit the new layers' weights on the calibration data (``init="calibrate"``); say what was not."""
    layers = []
    for name, old, new, spec in built:
        if spec.fused_act:  # the old layer's output includes its activation: no target for the norm alone
            report.notes.append(f"{name}: not calibrated (a fused norm+act layer); inherited weights")
            continue
        old.eval()  # out of the model now: BatchNorm's running statistics, no update
        layers.append((name, new, old))  # target: the old layer on the same input
    modules = dict(model.named_modules())
    layers += [(name, modules[name], _identity) for name in report.qk_added]  # target: the un-normed q/k
    report.calibration.update(calibrate(model, layers, calibration))
    biased = [(name, type(new).__name__) for name, old, new, _ in built
              if isinstance(getattr(old, "bias", None), nn.Parameter) and getattr(new, "bias", None) is None]
    if biased:
        report.notes.append(f"{len(biased)} calibrated layers had a bias that {biased[0][1]} cannot hold (e.g. "
                            f"{biased[0][0]}): the fit matches the rest, the bias stays in the residual error")
    missed = [name for name, _, _ in layers if name not in report.calibration]
    if missed:
        report.notes.append(f"not calibrated (the calibration data never reached them; inherited weights): "
                            f"{', '.join(missed[:5])}{' ...' if len(missed) > 5 else ''}")


def _identity(x: Any) -> Any:
    return x


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
