"""OutlierMonitor's figures computed directly in float64, and tiny nets with a planted outlier channel.

The reference is formulated apart from ``lightning_mrs.outlier_stats``: no per-token scaling,
``torch.quantile`` for the median, scipy for the kurtosis, float16 arithmetic itself for the
overflow, a ``(..., P, 2)`` pair axis with ``torch.linalg.vector_norm`` for the phasors.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from scipy import stats
from torch import Tensor, nn

from lightning_mrs import MRSNorm2d

__all__ = ["CONV_PLANTED", "HFStyleRMSNorm", "PLANTED", "TokenHead", "all_figure", "outlier_ref", "planted_net", "planted_reference"]

CAP = 1e12  # the ratio cap the monitor documents (lightning_mrs.stats.RATIO_CAP)
PLANTED = 40.0  # the factor of the planted token channel's weights
CONV_PLANTED = 250.0  # and of the planted conv channel's: some of its outputs pass 256


def outlier_ref(x: Tensor, channel_dim: int = -1) -> dict[str, float]:
    """Every figure of one input, straight from the definitions, in float64 (NaN/Inf entries
    counted, then read as 0); figures a layer does not define are absent."""
    x64 = x.detach().double().movedim(channel_dim, -1)
    tokens = x64.reshape(-1, x64.shape[-1])  # (T, C)
    t_count, c = tokens.shape
    nonfinite = (~tokens.isfinite()).sum().item()
    overflow = torch.isinf((tokens * tokens).to(torch.float16)).sum().item()  # float16's own rounding
    tokens = torch.nan_to_num(tokens, nan=0.0, posinf=0.0, neginf=0.0)
    sq, a = tokens**2, tokens.abs()
    zero = sq.sum(-1) == 0
    rms = torch.where(zero, 1.0 / c, sq.max(-1).values / sq.sum(-1).where(~zero, 1.0))
    median = torch.quantile(a, 0.5, dim=-1)  # linear interpolation: the mean of the two middle values
    ratio = torch.where(zero, 1.0, torch.where(median > 0, a.max(-1).values / median.where(median > 0, 1.0), CAP))
    out = {
        "absmax": a.max().item(),
        "rms_share": rms.max().item(),
        "outlier_ratio": min(ratio.max().item(), CAP),
        "x2_over_fp16_frac": overflow / tokens.numel(),
        "nonfinite": float(nonfinite),
    }
    if c % 2 == 0:
        r = torch.linalg.vector_norm(tokens.reshape(t_count, c // 2, 2), dim=-1)  # (T, P)
        out["mrs_share"] = torch.where(zero, 2.0 / c, r.max(-1).values / r.sum(-1).where(~zero, 1.0)).max().item()
    varied = tokens.numpy()[tokens.var(-1, correction=0).numpy() > 0]
    if len(varied):
        out["kurtosis"] = float(np.mean(stats.kurtosis(varied, axis=-1, fisher=False, bias=True)))
    return out


class HFStyleRMSNorm(nn.Module):
    """A model's own RMSNorm, unknown to the swap registry (as transformers' ``LlamaRMSNorm``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class TokenHead(nn.Module):
    """(N, C, H, W) -> (N, H*W, C) tokens -> Linear -> model's own RMSNorm -> Linear -> odd-width
    LayerNorm -> mean over tokens -> classes; channel 1 of the first Linear planted."""

    def __init__(self, c: int = 8, width: int = 6, odd: int = 5, classes: int = 5) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(c, width), HFStyleRMSNorm(width)
        self.mix, self.odd_norm, self.fc = nn.Linear(width, odd), nn.LayerNorm(odd), nn.Linear(odd, classes)
        with torch.no_grad():
            self.proj.weight[1] *= PLANTED

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.flatten(2).transpose(1, 2)  # (N, H*W, C)
        return self.fc(self.odd_norm(self.mix(self.norm(self.proj(tokens)))).mean(1))  # (N, classes)


def planted_net(batchnorm: bool = False) -> nn.Sequential:
    """Channels-first norms (GroupNorm, MRSNorm2d per position; ``batchnorm``: a BatchNorm2d
    first) on a conv whose channel 5 is planted, then :class:`TokenHead`'s channels-last ones.
    Without BatchNorm every figure is per sample: a batch split (accumulation, DDP) keeps them."""
    conv = nn.Conv2d(3, 8, 3, padding=1)
    with torch.no_grad():
        conv.weight[5] *= CONV_PLANTED
    first = [nn.BatchNorm2d(8)] if batchnorm else []
    return nn.Sequential(conv, *first, nn.GroupNorm(2, 8), nn.GELU(), MRSNorm2d(8), TokenHead())


def planted_reference(net: nn.Module, x: Tensor, channel_dims: dict[str, int], prefix: str = "net.",
                      ) -> dict[str, dict[str, float]]:
    """``outlier_ref`` of the input of each module in ``channel_dims`` (name -> its channel dim)
    in one forward of ``net`` on ``x``, keyed ``prefix + name``."""
    inputs: dict[str, Tensor] = {}
    modules = dict(net.named_modules())
    handles = [modules[name].register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0]))
               for name in channel_dims]
    try:
        with torch.no_grad():
            net(x)
    finally:
        for handle in handles:
            handle.remove()
    return {prefix + name: outlier_ref(inputs[name], dim) for name, dim in channel_dims.items()}


def all_figure(ref: dict[str, dict[str, float]], figure: str) -> Optional[float]:
    """The worst layer's ``figure`` (``outlier/all``), as the monitor aggregates it."""
    values = [row[figure] for row in ref.values() if figure in row]
    if not values:
        return None
    return sum(values) if figure == "nonfinite" else max(values)
