"""Per-phasor gradient statistics: the maths behind ``GradientHomogeneityMonitor``.

Needs only torch. Channels are paired exactly as MRSNorm pairs them: phasor ``i`` of a layer
is the channel pair ``(2i, 2i+1)`` along its channel dim. For one norm layer, from the
gradient ``g`` of the loss with respect to its *input* ``x`` (both of shape ``(N, C, *sp)``
or ``(..., C)``), the capture step reduces every call to a packed vector of per-phasor sums
(:func:`phasor_sums`)::

    [ grad_sq (P) | radial_sq (P) | act_abs (P) | count | nonfinite ]

* ``grad_sq[i]   = sum_n |g_i(n)|^2``, the squared norm of phasor ``i``'s gradient summed
  over every sample and position ``n``;
* ``radial_sq[i] = sum_n (g_i(n) . u_i(n))^2`` with ``u_i = x_i / |x_i|``: the part of that
  energy along the phasor's own direction (changes its magnitude; the rest turns its phase);
* ``act_abs[i]   = sum_n |x_i(n)|``, the input phasor magnitudes;
* ``count`` = the number of ``n`` (same for every phasor of a layer);
* ``nonfinite`` = the number of NaN/Inf entries of ``g`` (they are left out of the sums).

Sums add across calls, micro-batches and ranks, so accumulation and DDP reduce to one
``+=`` and one ``all_reduce`` of the packed buffer. :func:`layer_stats` turns a buffer into
the figures; every figure is finite (zeros and empty layers give documented neutral values,
never NaN).

Example:
    >>> x = torch.randn(4, 6, 5, 5, requires_grad=True)
    >>> y = (x * torch.randn(6, 1, 1)).square().sum()
    >>> y.backward()
    >>> sums = phasor_sums(x.detach(), x.grad, channel_dim=1)  # (3 * 3 + 2,)
    >>> stats, g_rms = layer_stats(sums, num_phasors=3)
    >>> dict(zip(STAT_NAMES, stats.tolist()))["grad_cv"] >= 0
    True
"""

from __future__ import annotations

import math
from typing import Union

import torch
from torch import Tensor

from lightning_mrs.ops.validation import phasor_channel_dim

__all__ = [
    "ALL_STAT_NAMES",
    "STAT_NAMES",
    "WEIGHT_STAT_NAMES",
    "aggregate_stats",
    "layer_stats",
    "phasor_grad_rms",
    "phasor_sums",
    "slot_size",
    "weight_grad_stats",
]

#: Per-layer figures, in the order of the vector :func:`layer_stats` returns.
STAT_NAMES: tuple[str, ...] = (
    "grad_mean",  # mean_i G_i: the absolute (unscaled) gradient level
    "grad_cv",  # std_i G_i / mean_i G_i: the homogeneity figure (0 = perfectly even)
    "grad_max_ratio",  # max_i G_i / median_i G_i: domination by one phasor
    "grad_p05",  # 5 % quantile of G_i (lower edge of the margin chart)
    "grad_p50",  # median of G_i (the margin chart's line)
    "grad_p95",  # 95 % quantile of G_i (upper edge)
    "starved_frac",  # share of phasors with G_i < threshold * median
    "radial_frac",  # share of gradient energy along each phasor's own direction
    "act_outlier_ratio",  # max_i A_i / mean_i A_i, A_i = mean input phasor magnitude
    "nonfinite",  # NaN/Inf gradient entries seen (excluded from everything above)
    "count",  # samples x positions the figures are computed over
)
#: Figures of an MRS layer's per-phasor weight gradient (see :func:`weight_grad_stats`).
WEIGHT_STAT_NAMES: tuple[str, ...] = ("wgrad_mean", "wgrad_cv")
#: Aggregates over layers, in the order of the vector :func:`aggregate_stats` returns.
ALL_STAT_NAMES: tuple[str, ...] = (
    "grad_mean",  # mean over layers of grad_mean
    "grad_cv",  # mean over layers of grad_cv
    "grad_cv_max",  # worst layer's grad_cv
    "grad_max_ratio",  # worst layer's grad_max_ratio
    "starved_frac",  # starved phasors / all phasors, pooled over layers
    "radial_frac",  # mean over layers of radial_frac
    "act_outlier_ratio",  # worst layer's act_outlier_ratio
    "nonfinite",  # sum over layers
    "layers",  # number of layers that received a gradient
)

#: Cap of every ratio figure (a zero denominator under a positive numerator gives the cap):
#: finite, and representable in the float32 TensorBoard stores.
RATIO_CAP = 1e12
_FP32_MAX = torch.finfo(torch.float32).max
_IDX = {name: i for i, name in enumerate(STAT_NAMES)}

Number = Union[float, int, Tensor]


def slot_size(num_phasors: int) -> int:
    """Length of a layer's packed sums vector: ``3 * P + 2``."""
    return 3 * num_phasors + 2


def phasor_sums(x: Tensor, grad: Tensor, channel_dim: int) -> Tensor:
    """Pack the per-phasor sums of one captured ``(input, input gradient)`` pair.

    Computed on the tensors' device without a host sync, in fp32 (fp64 for fp64 inputs):
    half-precision gradients are upcast before squaring.

    Args:
        x: the norm layer's input, any shape with ``C`` (even) channels along ``channel_dim``.
        grad: the gradient of the loss with respect to ``x`` (same shape). Divide by a
            GradScaler's scale later (:func:`layer_stats` ``grad_divisor``), not here.
        channel_dim: the channel dim (``1`` channels-first, ``-1`` channels-last).

    Returns:
        A ``(3 * P + 2,)`` vector ``[grad_sq | radial_sq | act_abs | count | nonfinite]``.

    Raises:
        ValueError: shapes differ or the channel dim is odd.

    Example:
        >>> x, g = torch.randn(2, 4), torch.randn(2, 4)
        >>> phasor_sums(x, g, channel_dim=-1).shape
        torch.Size([8])
    """
    if x.shape != grad.shape:
        raise ValueError(
            f"phasor_sums: input and gradient shapes differ: {tuple(x.shape)} vs "
            f"{tuple(grad.shape)}."
        )
    cd = phasor_channel_dim(x, channel_dim, "phasor_sums")
    channels = x.shape[cd]
    work = torch.float64 if grad.dtype == torch.float64 else torch.float32
    p = channels // 2
    lead = math.prod(x.shape[:cd])
    trail = math.prod(x.shape[cd + 1 :])
    with torch.no_grad():
        # canonical (A, P, 2, L) layout: a free view of contiguous tensors. Only cheap
        # element-wise kernels on the even/odd slices and (A, L) reductions follow
        # (isfinite/where and reductions over the pair dim are several times slower on CPU).
        raw = grad.reshape(lead, p, 2, trail).to(work)
        g = torch.nan_to_num(raw, nan=0.0, posinf=0.0, neginf=0.0)  # a copy: grad flows on untouched
        nonfinite = torch.count_nonzero(raw != g)  # () NaN/Inf entries: the only ones changed
        xw = torch.nan_to_num(x.reshape(lead, p, 2, trail).to(work), nan=0.0, posinf=0.0, neginf=0.0)
        ge, go = g[:, :, 0], g[:, :, 1]  # (A, P, L)
        xe, xo = xw[:, :, 0], xw[:, :, 1]  # (A, P, L)
        # in place from here: every fresh activation-sized buffer costs page faults on the CPU
        sq = (ge * ge).addcmul_(go, go)  # |g_i|^2
        r2 = (xe * xe).addcmul_(xo, xo)  # |x_i|^2
        radial = (ge * xe).addcmul_(go, xo).square_()  # (g_i . x_i)^2
        # radial energy (g_i . u_i)^2 <= |g_i|^2; a zero phasor (dot = 0) has none; the
        # minimum keeps rounding from pushing the share past 1
        r2.clamp_min_(torch.finfo(work).tiny)  # no 0/0; moves |x_i| of a zero phasor by 1e-19 only
        radial = torch.minimum(radial.div_(r2), sq, out=radial)
        return torch.cat(
            [
                sq.sum(dim=(0, 2)),  # (P,)
                radial.sum(dim=(0, 2)),  # (P,)
                r2.sqrt_().sum(dim=(0, 2)),  # (P,)
                sq.new_full((1,), lead * trail),  # a fill kernel: no host-to-device copy
                nonfinite.to(work).reshape(1),
            ]
        )


def phasor_grad_rms(sums: Tensor, num_phasors: int, grad_divisor: Number = 1.0) -> Tensor:
    """``G_i``: the RMS over samples and positions of phasor ``i``'s gradient norm.

    Args:
        sums: a packed vector from :func:`phasor_sums` (or a sum of them).
        num_phasors: ``P``.
        grad_divisor: what the captured gradients are multiplied by compared with the true
            gradient of the (global-batch) loss: the GradScaler's scale times, under DDP, the
            world size.

    Returns:
        ``(P,)`` float64 ``G_i``; zeros when nothing was captured. Overflowed sums saturate at
        the float32 maximum instead of becoming Inf.
    """
    p = num_phasors
    s = sums.to(torch.float64)
    count = s[3 * p]
    g_rms = (s[:p] / count.clamp_min(1.0)).sqrt() / grad_divisor  # (P,)
    return torch.nan_to_num(g_rms, nan=0.0, posinf=_FP32_MAX)


def _ratio(num: Tensor, den: Tensor, zero_over_zero: float) -> Tensor:
    """``num / den`` capped at :data:`RATIO_CAP`; ``0 / 0`` gives ``zero_over_zero``."""
    safe = den.clamp_min(torch.finfo(torch.float64).tiny)
    cap, neutral = num.new_tensor(RATIO_CAP), num.new_tensor(zero_over_zero)  # () in num's dtype
    out = torch.where(den > 0, num / safe, torch.where(num > 0, cap, neutral))
    return out.clamp(max=RATIO_CAP)


def layer_stats(
    sums: Tensor,
    num_phasors: int,
    *,
    grad_divisor: Number = 1.0,
    starved_threshold: float = 0.1,
) -> tuple[Tensor, Tensor]:
    """The per-layer figures of :data:`STAT_NAMES` from packed sums, on the sums' device.

    Definitions (``G_i`` from :func:`phasor_grad_rms`, ``A_i = act_abs[i] / count``):

    * ``grad_mean = mean_i G_i``; ``grad_cv = std_i G_i / mean_i G_i`` (population std;
      ``0`` when every ``G_i`` is 0).
    * ``grad_max_ratio = max_i G_i / median_i G_i`` (``1`` when all are 0).
    * ``grad_p05``, ``grad_p50``, ``grad_p95``: quantiles of ``G_i`` (linear interpolation).
    * ``starved_frac``: share of phasors with ``G_i < starved_threshold * median`` or, while
      some phasor gets a gradient, ``G_i == 0``.
    * ``radial_frac = sum_i radial_sq[i] / sum_i grad_sq[i]`` (``0`` without gradient): 0.5 for
      an isotropic gradient, 1 when the gradient only changes magnitudes, 0 only phases.
    * ``act_outlier_ratio = max_i A_i / mean_i A_i`` (``1`` for an all-zero input).
    * ``nonfinite``, ``count``: copied from the sums.

    Ratios are capped at :data:`RATIO_CAP`.

    Args:
        sums: packed ``(3 * P + 2,)`` vector (see :func:`phasor_sums`).
        num_phasors: ``P``.
        grad_divisor: see :func:`phasor_grad_rms`.
        starved_threshold: the starvation threshold relative to the median ``G_i``.

    Returns:
        ``(stats, G)``: a float64 vector ordered as :data:`STAT_NAMES` and the ``(P,)`` ``G_i``.

    Example:
        >>> sums = phasor_sums(torch.ones(3, 4), torch.ones(3, 4), channel_dim=-1)
        >>> stats, g_rms = layer_stats(sums, 2)
        >>> g_rms.tolist(), stats[STAT_NAMES.index("radial_frac")].item()
        ([1.4142135623730951, 1.4142135623730951], 1.0)
    """
    p = num_phasors
    if sums.ndim != 1 or sums.numel() != slot_size(p):
        raise ValueError(
            f"layer_stats: expected packed sums of shape ({slot_size(p)},) for {p} phasors, got "
            f"{tuple(sums.shape)}."
        )
    # fp32 sums of squares overflow only past |g| ~ 1e19: saturate them rather than make NaN
    s = torch.nan_to_num(sums.to(torch.float64), nan=0.0, posinf=_FP32_MAX)
    count, nonfinite = s[3 * p], s[3 * p + 1]
    g_rms = phasor_grad_rms(s, p, grad_divisor)  # (P,)
    zero = s.new_zeros(())
    mean = g_rms.mean()
    std = g_rms.std(correction=0) if p > 1 else zero
    q = torch.quantile(g_rms, g_rms.new_tensor([0.05, 0.5, 0.95]))  # (3,)
    median, g_max = q[1], g_rms.max()
    starved = (g_rms < starved_threshold * median) | ((g_rms == 0) & (g_max > 0))  # (P,)
    grad_sq_total = s[:p].sum()
    radial_frac = torch.where(
        grad_sq_total > 0, s[p : 2 * p].sum() / grad_sq_total.clamp_min(1e-300), zero
    ).clamp(0.0, 1.0)
    act = torch.nan_to_num(s[2 * p : 3 * p] / count.clamp_min(1.0), posinf=_FP32_MAX)  # (P,)
    stats = torch.stack(
        [
            mean,
            _ratio(std, mean, 0.0),
            _ratio(g_max, median, 1.0),
            q[0],
            median,
            q[2],
            starved.to(torch.float64).mean(),
            radial_frac,
            _ratio(act.max(), act.mean(), 1.0),
            nonfinite,
            count,
        ]
    )
    return stats, g_rms


def weight_grad_stats(weight_grad: Tensor) -> tuple[Tensor, Tensor]:
    """``(wgrad_mean, wgrad_cv)`` of an MRS layer's per-phasor weight gradient.

    ``wgrad_mean = mean_i |dL/dw_i|`` and ``wgrad_cv = std_i |dL/dw_i| / wgrad_mean``, over the
    finite entries; the second element of the result is the number of non-finite entries.

    Returns:
        ``(stats, nonfinite)``: a float64 ``(2,)`` vector ordered as
        :data:`WEIGHT_STAT_NAMES` and a 0-d float64 count.

    Example:
        >>> weight_grad_stats(torch.tensor([1.0, -3.0]))[0].tolist()
        [2.0, 0.5]
    """
    w = weight_grad.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(w)
    a = torch.where(finite, w, 0.0).abs()  # (P,)
    n = finite.sum().clamp_min(1).to(torch.float64)
    mean = a.sum() / n
    var = (torch.where(finite, a - mean, 0.0) ** 2).sum() / n
    stats = torch.stack([mean, _ratio(var.sqrt(), mean, 0.0)])
    return stats, (~finite).sum().to(torch.float64)


def aggregate_stats(stats: Tensor, num_phasors: Tensor) -> Tensor:
    """Aggregate per-layer figures into :data:`ALL_STAT_NAMES`.

    Layers with ``count == 0`` (no gradient reached them) are left out of everything but
    ``nonfinite``; with no layer left the figures are zeros.

    Args:
        stats: ``(L, len(STAT_NAMES))`` rows from :func:`layer_stats`.
        num_phasors: ``(L,)`` ``P`` of each layer.

    Returns:
        A float64 vector ordered as :data:`ALL_STAT_NAMES`.

    Example:
        >>> rows = torch.stack([layer_stats(phasor_sums(torch.ones(2, 4), torch.ones(2, 4), -1), 2)[0]])
        >>> aggregate_stats(rows, torch.tensor([2]))[ALL_STAT_NAMES.index("layers")].item()
        1.0
    """
    s = stats.to(torch.float64)
    nph = num_phasors.to(device=s.device, dtype=torch.float64)  # (L,)
    live = s[:, _IDX["count"]] > 0  # (L,)
    nonfinite = s[:, _IDX["nonfinite"]].sum()
    zero = s.new_zeros(())
    n_live = live.sum().to(torch.float64)

    def mean(col: str) -> Tensor:
        return torch.where(live, s[:, _IDX[col]], 0.0).sum() / n_live.clamp_min(1.0)

    def worst(col: str) -> Tensor:
        return torch.where(live, s[:, _IDX[col]], 0.0).max() if s.shape[0] else zero

    pooled_starved = torch.where(live, s[:, _IDX["starved_frac"]] * nph, 0.0).sum()
    phasors_live = torch.where(live, nph, 0.0).sum()
    return torch.stack(
        [
            mean("grad_mean"),
            mean("grad_cv"),
            worst("grad_cv"),
            worst("grad_max_ratio"),
            pooled_starved / phasors_live.clamp_min(1.0),
            mean("radial_frac"),
            worst("act_outlier_ratio"),
            nonfinite,
            n_live,
        ]
    )
