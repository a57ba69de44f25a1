"""``SwapOptions``: the options of a norm swap, shared by ``swap_norms`` and ``NormSwap``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

__all__ = ["SWAP_TARGETS", "Selector", "SwapOptions"]

SWAP_TARGETS = ("mrs", "rms", "layer")
_INITS = ("inherit", "ones")
_SPATIAL = ("auto", True, False)
Selector = Union[str, type, Iterable[Union[str, type]], None]


def _selectors(value: Selector, option: str) -> tuple[Union[str, type], ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, (str, type)) else tuple(value)
    for item in items:
        if not isinstance(item, (str, type)):
            raise TypeError(
                f"SwapOptions({option}=...): each entry must be a module type (e.g. nn.BatchNorm2d) "
                f"or a dotted-name pattern (e.g. 'head.*'), got {item!r}."
            )
    return items


@dataclass(frozen=True)
class SwapOptions:
    """What a norm swap does (see :func:`lightning_mrs.swap_norms`).

    Attributes:
        target: ``"mrs"`` (MRSNorm / MRSNorm2d), or the baselines ``"rms"`` (nn.RMSNorm /
            RMSNorm2d) and ``"layer"`` (nn.LayerNorm / LayerNorm2d / GroupNorm(1, C)).
        spatial: channels-first sources only. ``"auto"``: BatchNorm/GroupNorm/InstanceNorm
            become per-sample (one scale per sample over all positions), LayerNorm2d/RmsNorm2d
            stay per-position; ``True``/``False`` force per-sample / per-position.
        include: only swap norms of these types or whose dotted name (or an ancestor's)
            matches one of these fnmatch patterns; others are skipped and reported.
        exclude: never swap these (wins over ``include``).
        init: ``"inherit"``: new weights from the old ones (an MRS phasor weight is the mean of
            its two channels' weights, so zero-init residual branches stay zero; a bias and
            BatchNorm running statistics are dropped where the target has none); ``"ones"``:
            fresh weights.
        eps: the new layers' eps; ``None`` keeps each old layer's eps.
        strict: raise, listing every layer concerned, instead of skipping a norm for any
            reason other than ``include``/``exclude``.

    Example:
        >>> SwapOptions("rms", exclude="head").exclude
        ('head',)
    """

    target: str = "mrs"
    spatial: Union[str, bool] = "auto"
    include: Selector = None
    exclude: Selector = None
    init: str = "inherit"
    eps: Optional[float] = None
    strict: bool = False

    def __post_init__(self) -> None:
        if self.target not in SWAP_TARGETS:
            raise ValueError(f"SwapOptions: target={self.target!r} is not valid; choose one of {list(SWAP_TARGETS)}.")
        if not any(self.spatial is s for s in _SPATIAL) and self.spatial != "auto":
            raise ValueError(f"SwapOptions: spatial={self.spatial!r} is not valid; choose one of {list(_SPATIAL)}.")
        if self.init not in _INITS:
            raise ValueError(f"SwapOptions: init={self.init!r} is not valid; choose one of {list(_INITS)}.")
        eps = self.eps
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf):
            raise ValueError(f"SwapOptions: eps={eps!r} is not valid; choose None (keep each layer's eps) or a "
                             "finite float > 0.")
        object.__setattr__(self, "include", _selectors(self.include, "include"))
        object.__setattr__(self, "exclude", _selectors(self.exclude, "exclude"))

    @classmethod
    def of(cls, target: Union[str, "SwapOptions"], caller: str, **options: Any) -> "SwapOptions":
        """``target`` as options: a ``SwapOptions`` (with ``options`` replacing fields) or a
        target name with the other fields as keywords.

        Raises:
            TypeError: an unknown keyword, listing the valid ones.
        """
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise TypeError(f"{caller}: unknown option(s) {unknown}; valid options: {fields}.")
        if isinstance(target, SwapOptions):
            return dataclasses.replace(target, **options)
        return cls(target, **options)

    def describe(self) -> str:
        """The options that differ from the defaults, as keyword arguments."""
        default = SwapOptions()
        parts = [f"target={self.target!r}"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "target" and value != getattr(default, f.name):
                parts.append(f"{f.name}={value!r}")
        return ", ".join(parts)
