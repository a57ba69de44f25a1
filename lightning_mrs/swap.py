"""``swap_norms``: turn every norm layer of a model into MRSNorm (or RMSNorm / LayerNorm).

The swap first plans every layer (what it becomes, or why it is left alone), raises on any
problem under ``strict=True`` before touching the model, then rewrites the model in place.
See the README section "Swap the norms of your model" for the options table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Iterable, Optional, Union

from torch import nn

from lightning_mrs.norm_registry import NormSpec, norm_spec
from lightning_mrs.swap_build import Plan, build_replacement, plan_replacement

__all__ = ["swap_norms", "SwapReport", "SWAP_TARGETS"]

SWAP_TARGETS = ("mrs", "rms", "layer")
_INITS = ("inherit", "ones")
_SPATIAL = ("auto", True, False)
Selector = Union[str, type, Iterable[Union[str, type]], None]


@dataclass
class SwapReport:
    """What :func:`swap_norms` did.

    Attributes:
        target: ``"mrs"``, ``"rms"`` or ``"layer"``.
        converted: dotted names of the norm layers replaced (a shared instance under its
            first name; see ``aliases``).
        skipped: every norm layer left alone (all of its names) -> the reason.
        unchanged: names of norms that already were what the target asks for.
        changes: converted name -> ``(old class name, new layer label)``.
        aliases: other names of shared norm instances -> their first name.
        options: the options of the swap (with ``converted``, the swap spec a checkpoint
            stores to re-apply it).
        notes: things a user should know (e.g. hooks on an old layer that did not move).
    """

    target: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)
    changes: dict[str, tuple[str, str]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def counts(self) -> Counter:
        """``(old class, new label) -> count`` over the converted layers."""
        return Counter(self.changes.values())

    def merge(self, other: "SwapReport") -> "SwapReport":
        """Fold a later swap of the same model into this report (used by the callback)."""
        self.converted += [n for n in other.converted if n not in self.changes]
        self.changes.update(other.changes)
        self.skipped.update(other.skipped)
        self.unchanged = [n for n in dict.fromkeys(self.unchanged + other.unchanged) if n not in self.changes]
        self.aliases.update(other.aliases)
        self.notes += [n for n in other.notes if n not in self.notes]
        return self

    def __str__(self) -> str:
        skipped = {n: r for n, r in self.skipped.items() if n not in self.aliases}
        lines = [
            f"swap_norms(target={self.target!r}): {len(self.converted)} converted, "
            f"{len(skipped)} skipped, {len(self.unchanged)} already {self.target}"
        ]
        width = max((len(f"{o} -> {n}") for o, n in self.counts()), default=0)
        for (old, new), count in sorted(self.counts().items()):
            lines.append(f"  {f'{old} -> {new}':<{width}}  x{count}")
        qk = [n for n in self.converted if n.rsplit(".", 1)[-1] in ("q_norm", "k_norm")]
        if qk:
            lines.append(f"  ({len(qk)} of them attention QK-norms: phasor attention)")
        if self.aliases:
            lines.append(f"  ({len(self.aliases)} extra references to shared norms kept shared)")
        lines += [f"note: {note}" for note in self.notes]
        if skipped:
            by_reason: dict[str, list[str]] = {}
            for name, reason in skipped.items():
                by_reason.setdefault(reason, []).append(name or "<root>")
            lines.append(f"skipped ({len(skipped)}):")
            for reason, names in by_reason.items():
                shown = ", ".join(names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
                lines.append(f"  {shown}: {reason}")
        return "\n".join(lines)


def _as_list(value: Selector, option: str) -> list[Union[str, type]]:
    if value is None:
        return []
    items = [value] if isinstance(value, (str, type)) else list(value)
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"swap_norms({option}=...): each entry must be a module type (e.g. nn.BatchNorm2d) "
                f"or a dotted-name pattern (e.g. 'head.*'), got {item!r}."
            )
    return items


def _matches(module: nn.Module, names: list[str], selectors: list[Union[str, type]]) -> Optional[str]:
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


def _check_options(target: str, spatial: object, init: str, eps: Optional[float]) -> None:
    if target not in SWAP_TARGETS:
        raise ValueError(f"swap_norms: target={target!r} is not one of {SWAP_TARGETS}.")
    if not any(spatial is s or spatial == s for s in _SPATIAL) or isinstance(spatial, int) and not isinstance(spatial, bool):
        raise ValueError(f"swap_norms: spatial={spatial!r} must be one of {_SPATIAL}.")
    if init not in _INITS:
        raise ValueError(f"swap_norms: init={init!r} must be one of {_INITS}.")
    if eps is not None and not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"swap_norms: eps={eps!r} must be None (inherit each layer's eps) or a float > 0.")


def swap_norms(
    model: nn.Module,
    target: str = "mrs",
    *,
    spatial: Union[str, bool] = "auto",
    include: Selector = None,
    exclude: Selector = None,
    init: str = "inherit",
    eps: Optional[float] = None,
    strict: bool = False,
) -> SwapReport:
    """Replace the norm layers of ``model`` in place; return what was done.

    Args:
        model: any module (timm, torchvision, your own). Its root must not itself be a norm
            layer to replace: wrap it first, e.g. ``nn.Sequential(norm)``.
        target: ``"mrs"`` (MRSNorm / MRSNorm2d), or the baselines ``"rms"`` (nn.RMSNorm /
            RMSNorm2d) and ``"layer"`` (nn.LayerNorm / LayerNorm2d / GroupNorm(1, C)).
        spatial: channels-first sources only. ``"auto"``: BatchNorm/GroupNorm/InstanceNorm
            become per-sample (one scale per sample over all positions), LayerNorm2d/RmsNorm2d
            stay per-position; ``True``/``False`` force per-sample / per-position.
        include: only swap norms of these types or whose dotted name (or an ancestor's)
            matches one of these fnmatch patterns; others are skipped and reported.
        exclude: never swap these (wins over ``include``).
        init: ``"inherit"``: new weights from the old ones (an MRS phasor weight is the mean
            of its two channels' weights, so zero-init residual branches stay zero; a bias
            and BatchNorm running statistics are dropped where the target has none);
            ``"ones"``: fresh weights.
        eps: the new layers' eps; ``None`` keeps each old layer's eps.
        strict: raise, listing every layer concerned, instead of skipping a norm for any
            reason other than ``include``/``exclude``.

    Returns:
        A :class:`SwapReport`; ``print(report)`` gives the summary.

    Raises:
        ValueError: a bad option, the root is a norm, or (``strict``) a norm cannot be swapped.
            The model is untouched when this is raised.

    Example:
        >>> import torchvision
        >>> model = torchvision.models.resnet18()
        >>> report = swap_norms(model, "mrs")
        >>> len(report.converted), report.changes["bn1"]
        (20, ('BatchNorm2d', 'MRSNorm2d(spatial=True)'))
    """
    _check_options(target, spatial, init, eps)
    includes, excludes = _as_list(include, "include"), _as_list(exclude, "exclude")
    report = SwapReport(target, options=dict(target=target, spatial=spatial, init=init, eps=eps))

    # 1. collect every reference (parent, attr) -> child first: nothing mutates while iterating
    names: dict[int, list[str]] = {}  # id(module) -> all its dotted names, first one first
    refs: list[tuple[nn.Module, str, nn.Module]] = []
    for parent_name, parent in model.named_modules():
        for attr, child in vars(parent).get("_modules", {}).items():
            if child is not None:
                refs.append((parent, attr, child))
                names.setdefault(id(child), []).append(f"{parent_name}.{attr}" if parent_name else attr)

    # 2. plan: what each distinct norm becomes, or why it stays
    plans: dict[int, tuple[nn.Module, NormSpec, Plan]] = {}
    old_by_name: dict[str, nn.Module] = {}
    problems: list[str] = []
    for name, module in model.named_modules():
        spec = norm_spec(module)
        if spec is None:
            continue
        all_names = names.get(id(module), [name]) if name else [""]
        others = [n for n in all_names if n != name]

        def skip(reason: str, user: bool = False) -> None:
            for n in [name, *others]:
                report.skipped[n] = reason
            if strict and not user:
                problems.append(f"{name or '<root>'} ({type(module).__qualname__}): {reason}")

        hit = _matches(module, all_names, excludes) if excludes else None
        if hit is not None:
            skip(f"excluded by exclude={hit}", user=True)
            continue
        if includes and _matches(module, all_names, includes) is None:
            skip("not matched by include", user=True)
            continue
        if spec.unsupported:
            skip(spec.unsupported)
            continue
        plan = plan_replacement(module, spec, target, spatial)
        if plan is None:
            report.unchanged.append(name)
            continue
        if target == "mrs" and spec.num_channels % 2:
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
        plans[id(module)] = (module, spec, plan)
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            report.notes.append(f"{name}: hooks registered on the old {type(module).__qualname__} were not moved")
        old_by_name[name] = module
        report.converted.append(name)
        for alias in others:
            report.aliases[alias] = name
    if problems:
        raise ValueError(
            "swap_norms(strict=True): these norm layers cannot be swapped (nothing was changed):\n  "
            + "\n  ".join(problems)
        )

    # 3. build each replacement once, then point every reference at it (shared stays shared)
    new_modules = {key: build_replacement(m, spec, plan, init, eps) for key, (m, spec, plan) in plans.items()}
    for parent, attr, child in refs:
        new = new_modules.get(id(child))
        if new is not None:
            setattr(parent, attr, new)
    for name in report.converted:
        old, spec, plan = plans[id(old_by_name[name])]
        report.changes[name] = (type(old).__qualname__, plan.label + ("+act" if spec.fused_act else ""))
    return report
