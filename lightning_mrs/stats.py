"""Per-phasor gradient statistics: the maths behind ``GradientHomogeneityMonitor``.

Needs only torch. Channels are paired exactly as MRSNorm pairs them: phasor ``i`` of a layer
is the channel pair ``(2i, 2i+1)`` along its channel dim. For one norm layer, from the
gradient ``g`` of the loss with respect to its *input* ``x`` (both of shape ``(N, C, *sp)``
or ``(..., C)``), the capture step reduces every call to named per-phasor sums
(:class:`PhasorSums`, from :func:`phasor_sums`):

* ``grad_sq[i]   = sum_n |g_i(n)|^2``, the squared norm of phasor ``i``'s gradient summed
  over every sample and position ``n``;
* ``radial_sq[i] = sum_n (g_i(n) . u_i(n))^2`` with ``u_i = x_i / |x_i|``: the part of that
  energy along the phasor's own direction (changes its magnitude; the rest turns its phase);
* ``act_abs[i]   = sum_n |x_i(n)|``, the input phasor magnitudes;
* ``count`` = the number of ``n`` (same for every phasor of a layer);
* ``nonfinite`` = the number of NaN/Inf entries of ``g`` (they are left out of the sums).

Sums add (``a + b``) across calls, micro-batches and ranks. :func:`layer_stats` turns them
into a dict of named figures, :func:`aggregate_stats` pools such dicts over layers; every
figure is finite (zeros and empty layers give documented neutral values, never NaN).

Example:
    >>> x = torch.randn(4, 6, 5, 5, requires_grad=True)
    >>> y = (x * torch.randn(6, 1, 1)).square().sum()
    >>> y.backward()
    >>> sums = phasor_sums(x.detach(), x.grad, channel_dim=1)
    >>> sums.num_phasors
    3
    >>> stats, g_rms = layer_stats(sums)
    >>> stats["grad_cv"].item() >= 0
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import torch
from torch import Tensor

from lightning_mrs.ops.validation import phasor_channel_dim
from lightning_mrs.sums import Sums, sum_field

__all__ = [
    "ALL_STAT_NAMES",
    "STAT_NAMES",
    "WEIGHT_STAT_NAMES",
    "PhasorSums",
    "aggregate_stats",
    "layer_stats",
    "phasor_sums",
    "weight_grad_stats",
]

#: The keys of the dict :func:`layer_stats` returns (its docstring defines them).
STAT_NAMES: tuple[str, ...] = (
    "grad_mean", "grad_cv", "grad_max_ratio", "grad_p05", "grad_p50", "grad_p95", "starved_frac", "radial_frac",
    "act_outlier_ratio", "nonfinite", "finite", "count",
)
#: The keys of the dict :func:`weight_grad_stats` returns (an MRS layer's weight gradient).
WEIGHT_STAT_NAMES: tuple[str, ...] = ("wgrad_mean", "wgrad_cv", "wgrad_nonfinite", "wgrad_finite")
#: The keys of the dict :func:`aggregate_stats` returns.
ALL_STAT_NAMES: tuple[str, ...] = (
    "grad_mean",  # mean over layers of grad_mean
    "grad_cv",  # mean over layers of grad_cv
    "grad_cv_max",  # worst layer's grad_cv
    "grad_max_ratio",  # worst layer's grad_max_ratio
    "starved_frac",  # starved phasors / all phasors, pooled over layers
    "radial_frac",  # mean over layers of radial_frac
    "act_outlier_ratio",  # worst layer's act_outlier_ratio
    "nonfinite",  # sum over layers (all of them)
    "layers",  # number of layers whose figures went in: some finite gradient reached them
)

#: Cap of every ratio figure (a zero denominator under a positive numerator gives the cap):
#: finite, and representable in the float32 TensorBoard stores.
RATIO_CAP = 1e12
_FP32_MAX = torch.finfo(torch.float32).max

Number = Union[float, int, Tensor]


@dataclass(frozen=True)
class PhasorSums(Sums):
    """One layer's per-phasor sums (see the module docstring); they add with ``+``.

    Attributes:
        grad_sq: ``(P,)`` summed squared gradient norm of each phasor.
        radial_sq: ``(P,)`` the part of ``grad_sq`` along each phasor's direction.
        act_abs: ``(P,)`` summed input phasor magnitudes.
        count: ``()`` samples x positions summed over.
        nonfinite: ``()`` NaN/Inf gradient entries (left out of the sums).

    Example:
        >>> a = PhasorSums.zeros(2)
        >>> (a + a).grad_sq.shape, a.num_phasors
        (torch.Size([2]), 2)
    """

    grad_sq: Tensor = sum_field(vector=True)
    radial_sq: Tensor = sum_field(vector=True)
    act_abs: Tensor = sum_field(vector=True)
    count: Tensor = sum_field()
    nonfinite: Tensor = sum_field()

    @property
    def num_phasors(self) -> int:
        return self.grad_sq.shape[0]


def phasor_sums(x: Tensor, grad: Tensor, channel_dim: int) -> PhasorSums:
    """The per-phasor sums of one captured ``(input, input gradient)`` pair.

    Computed on the tensors' device without a host sync, in fp32 (fp64 for fp64 inputs):
    half-precision gradients are upcast before squaring.

    Args:
        x: the norm layer's input, any shape with ``C`` (even) channels along ``channel_dim``.
        grad: the gradient of the loss with respect to ``x`` (same shape). Divide by a
            GradScaler's scale later (:func:`layer_stats` ``grad_divisor``), not here.
        channel_dim: the channel dim (``1`` channels-first, ``-1`` channels-last).

    Returns:
        :class:`PhasorSums` with ``P = C / 2`` phasors.

    Raises:
        ValueError: shapes differ or the channel dim is odd.

    Example:
        >>> x, g = torch.randn(2, 4), torch.randn(2, 4)
        >>> phasor_sums(x, g, channel_dim=-1).count.item()
        2.0
    """
    if x.shape != grad.shape:
        raise ValueError(
            f"phasor_sums: input and gradient shapes differ: {tuple(x.shape)} vs "
            f"{tuple(grad.shape)}."
        )
    channel_dim = phasor_channel_dim(x, channel_dim, "phasor_sums")
    work = torch.float64 if grad.dtype == torch.float64 else torch.float32
    p = x.shape[channel_dim] // 2
    lead = math.prod(x.shape[:channel_dim])
    trail = math.prod(x.shape[channel_dim + 1 :])
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
        return PhasorSums(
            grad_sq=sq.sum(dim=(0, 2)),  # (P,)
            radial_sq=radial.sum(dim=(0, 2)),  # (P,)
            act_abs=r2.sqrt_().sum(dim=(0, 2)),  # (P,)
            count=sq.new_full((), lead * trail),  # a fill kernel: no host-to-device copy
            nonfinite=nonfinite.to(work),
        )


def _ratio(num: Tensor, den: Tensor, zero_over_zero: float) -> Tensor:
    """``num / den`` capped at :data:`RATIO_CAP`; ``0 / 0`` gives ``zero_over_zero``."""
    safe = den.clamp_min(torch.finfo(torch.float64).tiny)
    cap, neutral = num.new_tensor(RATIO_CAP), num.new_tensor(zero_over_zero)  # () in num's dtype
    out = torch.where(den > 0, num / safe, torch.where(num > 0, cap, neutral))
    return out.clamp(max=RATIO_CAP)


def layer_stats(
    sums: PhasorSums,
    *,
    grad_divisor: Number = 1.0,
    starved_threshold: float = 0.1,
) -> tuple[dict[str, Tensor], Tensor]:
    """The per-layer figures (:data:`STAT_NAMES`) from a layer's sums, on their device.

    Definitions (``G_i = sqrt(grad_sq[i] / count) / grad_divisor``, the RMS over samples and
    positions of phasor ``i``'s gradient norm, 0 when nothing was captured; ``A_i = act_abs[i] / count``):

    * ``grad_mean = mean_i G_i``; ``grad_cv = std_i G_i / mean_i G_i`` (population std;
      ``0`` when every ``G_i`` is 0).
    * ``grad_max_ratio = max_i G_i / median_i G_i`` (``1`` when all are 0).
    * ``grad_p05``, ``grad_p50``, ``grad_p95``: quantiles of ``G_i`` (linear interpolation).
    * ``starved_frac``: share of phasors with ``G_i < starved_threshold * median`` or, while
      some phasor gets a gradient, ``G_i == 0``.
    * ``radial_frac = sum_i radial_sq[i] / sum_i grad_sq[i]`` (``0`` without gradient): 0.5 for
      an isotropic gradient, 1 when the gradient only changes magnitudes, 0 only phases.
    * ``act_outlier_ratio = max_i A_i / mean_i A_i`` (``1`` for an all-zero input).
    * ``nonfinite``, ``count``: copied from the sums; ``finite = 2 P count - nonfinite``, the
      gradient entries the figures come from. With ``finite == 0`` (no gradient, or every
      entry NaN/Inf) the gradient figures take the neutral values above and mean nothing:
      callers leave them out (the monitor logs only ``nonfinite`` then).

    Ratios are capped at :data:`RATIO_CAP`; overflowed sums saturate at the float32 maximum
    instead of becoming Inf.

    Args:
        sums: :func:`phasor_sums` output (or a sum of them).
        grad_divisor: what the captured gradients are multiplied by compared with the true
            gradient of the (global-batch) loss: the GradScaler's scale times, under DDP, the
            world size.
        starved_threshold: the starvation threshold relative to the median ``G_i``.

    Returns:
        ``(stats, G)``: name -> float64 0-d tensor (keys :data:`STAT_NAMES`) and the ``(P,)`` ``G_i``.

    Example:
        >>> sums = phasor_sums(torch.ones(3, 4), torch.ones(3, 4), channel_dim=-1)
        >>> stats, g_rms = layer_stats(sums)
        >>> [round(g, 6) for g in g_rms.tolist()], stats["radial_frac"].item()
        ([1.414214, 1.414214], 1.0)
    """
    p = sums.num_phasors
    # fp32 sums of squares overflow only past |g| ~ 1e19: saturate them rather than make NaN
    s = {k: torch.nan_to_num(v.to(torch.float64), nan=0.0, posinf=_FP32_MAX) for k, v in sums.as_dict().items()}
    count, nonfinite = s["count"], s["nonfinite"]
    g_rms = torch.nan_to_num((s["grad_sq"] / count.clamp_min(1.0)).sqrt() / grad_divisor, nan=0.0, posinf=_FP32_MAX)
    zero = count.new_zeros(())
    mean = g_rms.mean()
    std = g_rms.std(correction=0) if p > 1 else zero
    q = torch.quantile(g_rms, g_rms.new_tensor([0.05, 0.5, 0.95]))  # (3,)
    median, g_max = q[1], g_rms.max()
    starved = (g_rms < starved_threshold * median) | ((g_rms == 0) & (g_max > 0))  # (P,)
    grad_sq_total = s["grad_sq"].sum()
    radial_frac = torch.where(
        grad_sq_total > 0, s["radial_sq"].sum() / grad_sq_total.clamp_min(1e-300), zero
    ).clamp(0.0, 1.0)
    act = torch.nan_to_num(s["act_abs"] / count.clamp_min(1.0), posinf=_FP32_MAX)  # (P,)
    stats = {
        "grad_mean": mean,
        "grad_cv": _ratio(std, mean, 0.0),
        "grad_max_ratio": _ratio(g_max, median, 1.0),
        "grad_p05": q[0],
        "grad_p50": median,
        "grad_p95": q[2],
        "starved_frac": starved.to(torch.float64).mean(),
        "radial_frac": radial_frac,
        "act_outlier_ratio": _ratio(act.max(), act.mean(), 1.0),
        "nonfinite": nonfinite,
        "finite": (2 * p * count - nonfinite).clamp_min(0.0),
        "count": count,
    }
    return stats, g_rms


def weight_grad_stats(weight_grad: Tensor) -> dict[str, Tensor]:
    """The figures of an MRS layer's per-phasor weight gradient (keys :data:`WEIGHT_STAT_NAMES`).

    ``wgrad_mean = mean_i |dL/dw_i|`` and ``wgrad_cv = std_i |dL/dw_i| / wgrad_mean``, over the
    finite entries; ``wgrad_nonfinite`` / ``wgrad_finite`` count the entries left out / used
    (with no finite entry the first two are 0 and mean nothing).

    Returns:
        name -> float64 0-d tensor, on the gradient's device.

    Example:
        >>> {k: v.item() for k, v in weight_grad_stats(torch.tensor([1.0, -3.0])).items()}
        {'wgrad_mean': 2.0, 'wgrad_cv': 0.5, 'wgrad_nonfinite': 0.0, 'wgrad_finite': 2.0}
    """
    w = weight_grad.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(w)
    a = torch.where(finite, w, 0.0).abs()  # (P,)
    n_finite = finite.sum().to(torch.float64)
    n = n_finite.clamp_min(1.0)
    mean = a.sum() / n
    var = (torch.where(finite, a - mean, 0.0) ** 2).sum() / n
    return {
        "wgrad_mean": mean,
        "wgrad_cv": _ratio(var.sqrt(), mean, 0.0),
        "wgrad_nonfinite": w.numel() - n_finite,
        "wgrad_finite": n_finite,
    }


def aggregate_stats(rows: Sequence[Mapping[str, Tensor]], num_phasors: Sequence[int]) -> dict[str, Tensor]:
    """Pool per-layer figures (:func:`layer_stats` dicts) into :data:`ALL_STAT_NAMES`.

    Layers without a finite gradient entry (``finite == 0``: none reached them, or all of it
    was NaN/Inf) are left out of everything but ``nonfinite``; with no layer left the figures
    are zeros.

    Args:
        rows: one :func:`layer_stats` dict per layer.
        num_phasors: ``P`` of each layer, in the same order.

    Returns:
        name -> float64 0-d tensor, on the rows' device.

    Example:
        >>> row, _ = layer_stats(phasor_sums(torch.ones(2, 4), torch.ones(2, 4), -1))
        >>> aggregate_stats([row], [2])["layers"].item()
        1.0
    """
    if len(rows) != len(num_phasors):
        raise ValueError(f"aggregate_stats: {len(rows)} rows but {len(num_phasors)} phasor counts.")
    if not rows:
        return {name: torch.zeros((), dtype=torch.float64) for name in ALL_STAT_NAMES}

    def col(name: str) -> Tensor:
        return torch.stack([row[name].to(torch.float64) for row in rows])  # (L,)

    live = col("finite") > 0  # (L,)
    nph = col("finite").new_tensor(list(num_phasors), dtype=torch.float64)  # (L,)
    n_live = live.sum().to(torch.float64)

    def mean(name: str) -> Tensor:
        return torch.where(live, col(name), 0.0).sum() / n_live.clamp_min(1.0)

    def worst(name: str) -> Tensor:
        return torch.where(live, col(name), 0.0).max()

    pooled_starved = torch.where(live, col("starved_frac") * nph, 0.0).sum()
    phasors_live = torch.where(live, nph, 0.0).sum()
    return {
        "grad_mean": mean("grad_mean"),
        "grad_cv": mean("grad_cv"),
        "grad_cv_max": worst("grad_cv"),
        "grad_max_ratio": worst("grad_max_ratio"),
        "starved_frac": pooled_starved / phasors_live.clamp_min(1.0),
        "radial_frac": mean("radial_frac"),
        "act_outlier_ratio": worst("act_outlier_ratio"),
        "nonfinite": col("nonfinite").sum(),
        "layers": n_live,
    }
