"""Independent float64 references: MRSNorm, written straight from docs/method.md, and the attention
figures of ``AttentionMonitor`` from a materialised softmax.

Deliberately formulated differently from ``lightning_mrs.ops.reference`` (channel dim moved
last, an explicit ``(..., P, 2)`` pair axis, ``torch.linalg.vector_norm`` for the magnitude)
so that the two can catch each other's mistakes. Differentiable, for gradient references.
"""

from __future__ import annotations

from typing import Optional, Sequence

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


def attention_ref(q: Tensor, k: Tensor, scale: float, pairs: Optional[Sequence[tuple[int, int]]] = None,
                  threshold: float = 0.99) -> dict[str, float]:
    """The attention figures of queries ``pairs`` ((sample, position); all: None) of ``q (B, H, N, D)``
    against every key of ``k (B, Hk, Nk, D)`` of the same sample (query head h uses key head
    ``h // (H / Hk)``), from every logit ``scale * q . k`` and its softmax, in float64."""
    q64, k64 = q.double(), k.double()
    pairs = list(pairs) if pairs is not None else [(b, n) for b in range(q.shape[0]) for n in range(q.shape[2])]
    k_full = k64.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, Nk, D)
    rows = torch.stack([torch.einsum("hd,hmd->hm", q64[b, :, n], k_full[b]) * scale for b, n in pairs])  # (Q, H, Nk)
    weights = rows.softmax(dim=-1)
    entropy = torch.special.entr(weights).sum(-1)  # (Q, H): -sum p ln p, 0 ln 0 = 0
    samples = sorted({b for b, _ in pairs})
    return {
        "logit_max": rows.abs().max().item(),
        "entropy_mean": entropy.mean().item(),
        "entropy_min": entropy.mean(0).min().item(),  # the lowest head's mean over the queries
        "collapsed_frac": (weights.max(-1).values > threshold).double().mean().item(),
        "q_norm_mean": torch.stack([q64[b, :, n] for b, n in pairs]).norm(dim=-1).mean().item(),
        "k_norm_mean": k64[samples].norm(dim=-1).mean().item(),  # the keys of the sampled samples
    }
