"""``SwapReport``: what a norm swap did, layer by layer."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lightning_mrs.swap.options import SwapOptions

__all__ = ["SwapReport"]


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
        options: the options of the swap.
        notes: things a user should know (e.g. hooks on an old layer that did not move).
    """

    target: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    unchanged: list[str] = field(default_factory=list)
    changes: dict[str, tuple[str, str]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    options: SwapOptions = field(default_factory=SwapOptions)
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
