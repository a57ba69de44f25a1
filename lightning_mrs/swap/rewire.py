"""``rewire``: point every reference to a module at its replacement, the last step of every swap.

:func:`lightning_mrs.swap_norms` builds each new layer once, then calls :func:`rewire`; a norm
instance shared by several parents (its several dotted names) stays shared.
"""

from __future__ import annotations

from torch import nn

__all__ = ["rewire"]


def rewire(model: nn.Module, replacements: dict[int, nn.Module]) -> None:
    """Point every reference to an old module (by ``id``) at its replacement (shared stays shared).

    The modules are listed before any reference changes, so a replacement's own children are
    not visited.

    Example:
        >>> shared = nn.LayerNorm(4)
        >>> model = nn.Sequential(shared, nn.ReLU(), shared)
        >>> new = nn.RMSNorm(4)
        >>> rewire(model, {id(shared): new})
        >>> model[0] is new and model[2] is new
        True
    """
    for parent in list(model.modules()):
        for attr, child in list(parent._modules.items()):
            if child is not None and id(child) in replacements:
                setattr(parent, attr, replacements[id(child)])
