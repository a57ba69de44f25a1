"""``SwapReport``: what a norm swap did, layer by layer."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from lightning_mrs.swap.attention_info import is_qk_name
from lightning_mrs.swap.options import SwapOptions

__all__ = ["SwapReport", "by_reason", "check_report"]


@dataclass
class SwapReport:
    """What :func:`swap_norms` did.

    Attributes:
        target: ``"mrs"``, ``"rms"`` or ``"layer"``, or ``None`` (body norms kept).
        converted: dotted names of the norm layers replaced (a shared instance under its
            first name; see ``aliases``).
        skipped: every norm layer left alone (all of its names) -> the reason.
        unchanged: names of norms that already were what the target asks for.
        changes: converted name -> ``(old class name, new layer label)``.
        aliases: other names of shared norm instances -> their first name.
        options: the options of the swap.
        notes: things a user should know (e.g. hooks on an old layer that did not move).
        qk_added: QK-norms added where an attention layer had none: dotted name of the new
            norm (``<layer>.q_norm``) -> its label (``"MRSNorm(64)"``). Existing QK-norms that
            changed kind are in ``converted``.
        attention_replaced: torch/torchvision attention layers rebuilt to take a QK-norm:
            name -> ``(old class name, new class name)``.
        attention_skipped: attention layers that got no QK-norm -> the reason.
        probed: converted layers recognised by running them (a transformers ``*RMSNorm``...;
            :mod:`lightning_mrs.swap.probe`) -> the formula found (``"rms(x) * (1 + w), eps=1e-06"``).
        calibration: ``init="calibrate"``: each calibrated layer (added QK-norms included) ->
            its relative output error ``||y - t|| / ||t||`` against its target with the
            inherited weights and with the fitted ones (:mod:`lightning_mrs.swap.calibrate`).

    Example:
        >>> from torch import nn
        >>> from lightning_mrs import swap_norms
        >>> report = swap_norms(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), "mrs")
        >>> report.converted, report.changes["1"]
        (['1'], ('LayerNorm', 'MRSNorm'))
    """

    target: Optional[str]
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)
    changes: dict[str, tuple[str, str]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    options: SwapOptions = field(default_factory=SwapOptions)
    notes: list[str] = field(default_factory=list)
    qk_added: dict[str, str] = field(default_factory=dict)
    attention_replaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    attention_skipped: dict[str, str] = field(default_factory=dict)
    probed: dict[str, str] = field(default_factory=dict)
    calibration: dict[str, tuple[float, float]] = field(default_factory=dict)

    def counts(self) -> Counter:
        """``(old class, new label) -> count`` over the converted layers."""
        return Counter(self.changes.values())

    def merge(self, other: "SwapReport") -> "SwapReport":
        """Fold a later swap of the same model into this report (used by the callback)."""
        self.converted += [n for n in other.converted if n not in self.changes]
        self.changes.update(other.changes)
        self.probed.update(other.probed)
        self.calibration.update(other.calibration)
        self.skipped.update(other.skipped)
        self.unchanged = [n for n in dict.fromkeys(self.unchanged + other.unchanged) if n not in self.changes]
        self.aliases.update(other.aliases)
        self.notes += [n for n in other.notes if n not in self.notes]
        self.qk_added.update(other.qk_added)
        self.attention_replaced.update(other.attention_replaced)
        self.attention_skipped = {n: r for n, r in {**self.attention_skipped, **other.attention_skipped}.items()
                                  if not any(k.startswith(f"{n}.") for k in self.qk_added)}
        return self

    def __str__(self) -> str:
        skipped = {n: r for n, r in self.skipped.items() if n not in self.aliases}
        qk_norm = self.options.qk_norm
        lines = [
            f"swap_norms(target={self.target!r}{'' if qk_norm is None else f', qk_norm={qk_norm!r}'}): "
            f"{len(self.converted)} converted, {len(skipped)} skipped, "
            f"{len(self.unchanged)} already {self.target or self.options.qk_kind or 'as asked'}"
            # target=None keeps the body's norms: only QK-norms are counted
            + ("" if self.target is not None else " (QK-norms only; body norms kept)")
        ]
        width = max((len(f"{o} -> {n}") for o, n in self.counts()), default=0)
        for (old, new), count in sorted(self.counts().items()):
            lines.append(f"  {f'{old} -> {new}':<{width}}  x{count}")
        found = Counter((self.changes[n][0], formula) for n, formula in self.probed.items() if n in self.changes)
        for (old, formula), count in sorted(found.items()):
            lines.append(f"  (probed: {old} computes {formula})  x{count}")
        qk = [n for n in self.converted if is_qk_name(n)]
        if qk:
            lines.append(f"  ({len(qk)} of them attention QK-norms: phasor attention)")
        if self.aliases:
            lines.append(f"  ({len(self.aliases)} extra references to shared norms kept shared)")
        lines += self._attention_lines()
        lines += self._calibration_lines()
        lines += [f"note: {note}" for note in self.notes]
        if skipped:
            lines.append(f"skipped ({len(skipped)}):")
            lines += by_reason(skipped)
        return "\n".join(lines)

    def _calibration_lines(self) -> list[str]:
        """One line for the body norms and one for the added QK-norms: the output errors."""
        lines = []
        qk = {n for n in self.calibration if n in self.qk_added}
        for label, names in (("norms", [n for n in self.calibration if n not in qk]), ("added QK-norms", sorted(qk))):
            if not names:
                continue
            before = sorted(self.calibration[n][0] for n in names)
            after = sorted(self.calibration[n][1] for n in names)
            lines.append(f"calibrated {len(names)} {label}: relative output error inherit -> calibrated, median "
                         f"{before[len(before) // 2]:.3g} -> {after[len(after) // 2]:.3g}, worst {before[-1]:.3g} -> "
                         f"{after[-1]:.3g} (per layer: report.calibration)")
        return lines

    def _attention_lines(self) -> list[str]:
        """The QK-norms added, apart from the converted norms, and the attention layers skipped."""
        lines = []
        if self.qk_added:
            layers = {name.rsplit(".", 1)[0] for name in self.qk_added}
            labels = ", ".join(f"{label} x{n}" for label, n in sorted(Counter(self.qk_added.values()).items()))
            plural = "s" if len(layers) > 1 else ""
            lines.append(f"QK-norms added: {len(self.qk_added)} in {len(layers)} attention layer{plural} ({labels})")
        for (old, new), count in sorted(Counter(self.attention_replaced.values()).items()):
            lines.append(f"  {old} -> {new} (same weights, takes the QK-norm)  x{count}")
        if self.attention_skipped:
            lines.append(f"attention layers without a QK-norm ({len(self.attention_skipped)}):")
            lines += by_reason(self.attention_skipped)
        return lines


def by_reason(skipped: dict[str, str]) -> list[str]:
    """One line per reason with the first few names it applies to."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        by_reason.setdefault(reason, []).append(name or "<root>")
    lines = []
    for reason, names in by_reason.items():
        shown = ", ".join(names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
        lines.append(f"  {shown}: {reason}")
    return lines


def check_report(model: nn.Module, report: SwapReport, built: dict[str, nn.Module]) -> None:
    """Raise if the model does not hold what ``report`` lists (the last step of every swap).

    Every converted name (and alias) must hold the very module built for it, every added QK-norm
    must sit where its name says, of the class its label says, in a layer that was rebuilt or
    hooked. A mismatch is a bug of the swap itself: nothing else could be trusted after it.

    Args:
        built: converted name -> the new module made for it.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    wrong = [f"{name}: holds {type(modules.get(name)).__qualname__}, not the new {type(new).__qualname__}"
             for name, new in built.items() if modules.get(name) is not new]
    wrong += [f"{alias}: not the new layer of {name}" for alias, name in report.aliases.items()
              if name in built and modules.get(alias) is not built[name]]
    for name, label in report.qk_added.items():
        parent = name.rsplit(".", 1)[0]
        layer, norm = modules.get(parent), modules.get(name)
        if norm is None or not label.startswith(f"{type(norm).__name__}("):
            wrong.append(f"{name}: holds {type(norm).__qualname__}, not the added {label}")
        changed = report.attention_replaced.get(parent)
        hooked = layer is not None and "_lightning_mrs_qk" in vars(layer)
        if changed is not None and not hooked and type(layer).__qualname__ != changed[1]:
            wrong.append(f"{parent}: holds {type(layer).__qualname__}, neither the rebuilt {changed[1]} nor hooked")
    if wrong:
        raise RuntimeError("swap_norms: the model does not hold what the swap reports (a bug of lightning-mrs; "
                           "please report it):\n  " + "\n  ".join(wrong[:10]))
