"""``include``/``exclude``: how a swap's selectors pick layers, and the check that each picks one.

A string selector is an ``fnmatch`` pattern matched against a module's **whole dotted name**
or the whole dotted name of one of its ancestors (which then selects the subtree), never
against a part of a name: on a Qwen3, ``"model.layers.0.self_attn.q_norm"`` and
``"model.layers.0"`` (the whole first block) match, ``"q_norm"`` does not, ``"*.q_norm"`` (every
layer's query norm) and ``"*self_attn*"`` do. A type selects the modules that are instances of it.

A selector that picks no module of the model is a mistake (a typo, or a part of a name), and a
swap that ran on would convert what the user meant to keep: :func:`check_selectors` raises,
naming the option and the names the user probably meant, before the model is touched.
"""

from __future__ import annotations

import difflib
from fnmatch import fnmatchcase
from typing import Iterable, Optional, Union

from torch import nn

from lightning_mrs.swap.options import INITIAL_SCALARS, SwapOptions

__all__ = ["check_selectors", "deselected", "initial_scalars", "matches"]


def matches(module: nn.Module, names: list[str], selectors: tuple[Union[str, type], ...]) -> Optional[str]:
    """The first selector that picks ``module`` (by type) or one of its names (by pattern,
    the pattern matching the whole name or the whole name of an ancestor)."""
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


def deselected(opts: SwapOptions, module: nn.Module, names: list[str]) -> Optional[str]:
    """Why ``include``/``exclude`` leave ``module`` out, or ``None``."""
    hit = matches(module, names, opts.exclude) if opts.exclude else None
    if hit is not None:
        return f"excluded by exclude={hit}"
    return "not matched by include" if opts.include and matches(module, names, opts.include) is None else None


def initial_scalars(opts: SwapOptions, module: nn.Module, names: list[str]) -> dict[str, float]:
    """The initial scalars the options give the layer that replaces ``module`` (``SwapOptions.alpha0`` and
    ``shift0``): per option set, its value or the value of its first pattern that picks the layer; an option
    unset, or whose patterns pick nothing here, is left out (the new layer's own default applies)."""
    found = {}
    for option in INITIAL_SCALARS:
        value = getattr(opts, option)
        if not isinstance(value, tuple):  # None or one float (SwapOptions checked it)
            if value is not None:
                found[option] = value
            continue
        hit = next((v for pattern, v in value if matches(module, names, (pattern,)) is not None), None)
        if hit is not None:
            found[option] = hit
    return found


def _hint(pattern: str, names: list[str]) -> str:
    """The names ``pattern`` was probably meant to match, as a sentence."""
    for wider in (f"*.{pattern}", f"*{pattern}*"):
        hits = [n for n in names if fnmatchcase(n, wider)]
        if hits:
            shown = ", ".join(hits[:3]) + (", ..." if len(hits) > 3 else "")
            return f"; to match it as a part of a name, write {wider!r} ({len(hits)} modules: {shown})"
    close = difflib.get_close_matches(pattern, names, n=5, cutoff=0.6)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    close += [f"*.{leaf}" for leaf in difflib.get_close_matches(pattern, leaves, n=3, cutoff=0.6)]
    return f"; close names: {', '.join(map(repr, close))}" if close else ""


def check_selectors(owner: str, opts: SwapOptions, model: nn.Module, names: Iterable[str]) -> None:
    """Raise a ``ValueError`` naming ``owner`` for each ``include``/``exclude`` entry that picks
    no module of ``model`` (``names``: every dotted name the swap knows, added QK-norms' included).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> check_selectors("swap_norms", SwapOptions(exclude="1"), model, ["0", "1"])  # picks "1"
        >>> check_selectors("swap_norms", SwapOptions(exclude="norm"), model, ["0", "1"])
        Traceback (most recent call last):
        ...
        ValueError: swap_norms: exclude='norm' matches no module of Sequential (patterns match a whole dotted name or an ancestor's, e.g. '1'); nothing was changed.
    """
    names = sorted(set(names))
    types = {type(m) for m in model.modules()}
    problems = []
    scalars = [(o, tuple(p for p, _ in getattr(opts, o))) for o in INITIAL_SCALARS if isinstance(getattr(opts, o), tuple)]
    for option, selectors in (("include", opts.include), ("exclude", opts.exclude), *scalars):
        for sel in selectors:
            if isinstance(sel, type):
                if not any(issubclass(t, sel) for t in types):
                    norms = sorted({t.__qualname__ for t in types if "norm" in t.__name__.lower()})
                    problems.append(f"{option}={sel.__qualname__} matches no module of {type(model).__qualname__} "
                                    f"(its norm types: {', '.join(norms) or 'none'})")
            elif not any(fnmatchcase(n, sel) for n in names):
                example = next((n for n in names if "norm" in n.lower()), names[-1] if names else "head")
                problems.append(f"{option}={sel!r} matches no module of {type(model).__qualname__} (patterns match "
                                f"a whole dotted name or an ancestor's, e.g. {example!r}){_hint(sel, names)}")
    if problems:
        raise ValueError(f"{owner}: " + "; ".join(problems) + "; nothing was changed.")
