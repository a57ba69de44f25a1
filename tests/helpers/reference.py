"""An independent float64 reference of MRSNorm, written straight from PAPER.md.

Deliberately formulated differently from ``lightning_mrs.ops.reference`` (channel dim moved
last, an explicit ``(..., P, 2)`` pair axis, ``torch.linalg.vector_norm`` for the magnitude)
so that the two can catch each other's mistakes. Differentiable, for gradient references.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def mrs_norm_ref(
    x: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    channel_dim: int = -1,
    spatial: bool = False,
) -> Tensor:
    """``y = w_i * z_i / S`` with ``S = mean_i sqrt(|z_i|^2 + eps)``, computed in float64."""
    x64 = x.double().movedim(channel_dim, -1)  # (..., C)
    pairs = x64.reshape(*x64.shape[:-1], x64.shape[-1] // 2, 2)  # (..., P, 2); explicit P: empty inputs
    r = torch.sqrt(torch.linalg.vector_norm(pairs, dim=-1) ** 2 + eps)  # (..., P)
    if spatial:
        # one S per sample: the mean over every phasor at every position
        s = r.flatten(1).mean(dim=1).reshape((-1,) + (1,) * (r.ndim - 1))
    else:
        s = r.mean(dim=-1, keepdim=True)  # (..., 1)
    y = pairs / s.unsqueeze(-1)  # (..., P, 2)
    if weight is not None:
        y = y * weight.double().unsqueeze(-1)  # (P, 1) broadcast over each pair
    return y.reshape(x64.shape).movedim(-1, channel_dim)


def rms_norm_ref(x: Tensor, eps: float = 1e-6) -> Tensor:
    """Plain RMSNorm over the last dim in float64, for comparisons."""
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).mean(dim=-1, keepdim=True) + eps)
