"""The half-precision norms inside float16 autocast: their inputs cast to float16, and the dtypes they saw.

Under float16 autocast (``16-mixed``) a transformer's residual stream stays float32 (a float16 matmul
output added to a float32 residual is float32), so every norm's input is float32 and even the
experimental half-precision norms of :mod:`lightning_mrs.swap.half` would compute in float32. To put
them where the paper's premise puts them, inside an otherwise standard mixed-precision run (float32
master weights, float16 autocast matmuls, a loss scaler), :class:`HalfInputs` casts a float32 input of
each such norm to float16 whenever float16 autocast is on for its device, as autocast casts the input
of an op on its float16 list; its weight is float32 and the layer casts it to its input's dtype. It
records the dtype each forward computed in, so a run can show that the norm really did compute in
float16 (:attr:`HalfInputs.seen`). Imported only where a cell trains.

Example:
    >>> from torch import nn
    >>> from lightning_mrs.swap.half import RMSNormHalf
    >>> model = nn.Sequential(nn.Linear(4, 4), RMSNormHalf(4))
    >>> inputs = HalfInputs(model)
    >>> with torch.autocast("cpu", dtype=torch.float16):
    ...     y = model(torch.randn(2, 4)) + torch.zeros(2, 4)  # a float32 residual beside it
    >>> dict(inputs.seen), y.dtype
    ({'torch.float16': 1}, torch.float32)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from lightning_mrs.swap.half import MRSNormHalf, RMSNormHalf

__all__ = ["HalfInputs"]


class HalfInputs:
    """Forward pre-hooks on every half-precision norm of ``model``: float16 inputs under float16 autocast.

    Raises:
        ValueError: ``model`` has no half-precision norm (nothing would compute in float16).
    """

    def __init__(self, model: nn.Module) -> None:
        norms = [m for m in model.modules() if isinstance(m, (RMSNormHalf, MRSNormHalf))]
        if not norms:
            raise ValueError("HalfInputs: the model has no RMSNormHalf/MRSNormHalf layer (swap_norms(model, "
                             "'rms-half') first): no norm would compute in float16.")
        self.seen: Counter[str] = Counter()  # the dtype of each forward's (possibly cast) input -> calls
        self.handles = [n.register_forward_pre_hook(self._cast) for n in norms]

    def _cast(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        kind = x.device.type
        if (x.dtype == torch.float32 and torch.is_autocast_enabled(kind)
                and torch.get_autocast_dtype(kind) == torch.float16):
            x = x.to(torch.float16)  # the cast autocast makes for an op on its float16 list
        self.seen[str(x.dtype)] += 1
        return (x, *args[1:])

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
