"""Activation-outlier statistics of a norm layer's input: the maths behind ``OutlierMonitor``.

Needs only torch. The premise of ``docs/method.md`` is that one large channel dominates
RMSNorm's denominator ``sum_c x_c^2`` quadratically (and overflows it past ``|x| = 256`` when
the squares are formed in float16), where MRSNorm's mean of pair magnitudes takes it in
linearly. These figures measure that on the tensor that enters a norm layer.

A *token* is one vector of ``C`` channels: the last dim of a channels-last input
``(..., C)``, dim 1 of a channels-first one ``(N, C, *spatial)`` (one token per sample and
position). Per token ``x = (x_1 .. x_C)``, with ``a_c = |x_c|``:

* ``rms_share  = max_c x_c^2 / sum_c x_c^2``: the largest channel's share of RMSNorm's
  denominator, in ``[1/C, 1]``;
* ``mrs_share  = max_i r_i / sum_i r_i`` with ``r_i = sqrt(x_{2i}^2 + x_{2i+1}^2)``: the
  largest phasor's share of MRSNorm's (even ``C`` only; ``P = C/2`` pairs), in ``[1/P, 1]``;
* ``outlier_ratio = max_c a_c / median_c a_c`` (the median of an even count is the mean of
  the two middle values): the "massive activations" measure of Sun et al. 2024
  (arXiv 2402.17762), ``>= 1``;
* ``kurtosis = mean_c d_c^4 / (mean_c d_c^2)^2`` with ``d_c = x_c - mean_c x_c`` (Pearson's,
  not the excess: 3 for Gaussian channels, about ``C`` for one outlier among ``C``).

Reductions over tokens (and calls, micro-batches, ranks), chosen so that each one is exact
under a split of the batch:

* ``absmax`` (the largest ``|x|`` of the layer), ``rms_share``, ``mrs_share`` and
  ``outlier_ratio``: the **maximum over tokens**: an outlier lives in a few tokens (Sun et
  al.'s sit on the first token and delimiters), which a mean would wash out;
* ``kurtosis``: the **mean over tokens**: how heavy-tailed a typical token's channels are
  (the worst token is what ``outlier_ratio`` shows);
* ``x2_over_fp16_frac``: inputs (entries) whose square *would* overflow float16 if it were
  formed in float16, i.e. round past 65504: ``|x| >= sqrt(65520) ~ 255.97`` (for float16 inputs
  exactly ``|x| >= 256``), ``±Inf`` included, over all entries. It says how much of the input a
  norm that squares in half precision could not square; torch's and transformers' RMSNorms and
  MRSNorm square in float32, so in their runs nothing it counts overflowed. (Called
  ``fp16_overflow_frac`` in lightning-mrs 0.2.0 and before: same value, :data:`RENAMED`.)
* ``nonfinite``: the count of NaN/Inf entries; they are set to 0 for every other figure.

Numerics: computed in float32 (float64 inputs in float64) whatever the input dtype or
autocast, on each token scaled by its own largest ``|x_c|`` (every figure but ``absmax`` is
scale-free, and no square overflows or underflows that way). Zeros give no NaN: a token of
zeros counts as perfectly even (``rms_share = 1/C``, ``mrs_share = 1/P``, ``outlier_ratio
= 1``); a zero median under a non-zero maximum gives ``outlier_ratio =``
:data:`~lightning_mrs.stats.RATIO_CAP`; a token whose channels are all equal (zeros included,
``C = 1`` always) has no kurtosis and is left out of its mean (:attr:`OutlierSums.kurtosis_tokens`).
The monitor leaves out ``mrs_share`` (:data:`FIGURES`: its ``needs``) when no token had an even ``C``, and
``kurtosis`` when no token had one.

Example:
    >>> x = torch.ones(4, 8)
    >>> x[:, 3] = 50.0  # a planted outlier channel
    >>> s = outlier_sums(x)
    >>> [round(FIGURES[f].formula(s).item(), 4) for f in ("rms_share", "mrs_share", "outlier_ratio")]
    [0.9972, 0.9218, 50.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_mrs.stats import RATIO_CAP
from lightning_mrs.sums import Figure, Sums, max_field, sum_field

__all__ = [
    "FIGURES",
    "FIGURE_NAMES",
    "FP16_SQUARE_OVERFLOW",
    "OutlierSums",
    "RENAMED",
    "outlier_sums",
]

#: old figure name -> its name now (the value is the same): OutlierMonitor(figures=...) takes the old one
#: with a warning, and the TensorBoard layout charts both tags, so runs logged before the rename line up.
RENAMED: dict[str, str] = {"fp16_overflow_frac": "x2_over_fp16_frac"}
#: ``|x|`` from which ``x * x`` rounds to Inf in float16 (65504 is its largest finite value;
#: a product rounds up to Inf from halfway to the next power step, 65520).
FP16_SQUARE_OVERFLOW = math.sqrt(65520.0)


@dataclass(frozen=True)
class OutlierSums(Sums):
    """One layer's reduced input statistics; they combine with ``+`` (maximum or sum per field).

    Every field is a 0-d tensor. Taken with the maximum: ``absmax``, ``rms_share``,
    ``mrs_share``, ``outlier_ratio`` (all ``>= 0``, so 0 is the empty value). Added:

    Attributes:
        overflow: entries whose square would overflow float16 (``|x| >= 255.97``).
        entries: entries seen.
        kurtosis_sum: summed kurtosis of the tokens that have one.
        kurtosis_tokens: tokens that have one (their channels are not all equal).
        mrs_tokens: tokens with an even channel count (``mrs_share`` is theirs).
        tokens: tokens seen.
        nonfinite: NaN/Inf entries.
    """

    absmax: Tensor = max_field()
    rms_share: Tensor = max_field()
    mrs_share: Tensor = max_field()
    outlier_ratio: Tensor = max_field()
    overflow: Tensor = sum_field()
    entries: Tensor = sum_field()
    kurtosis_sum: Tensor = sum_field()
    kurtosis_tokens: Tensor = sum_field()
    mrs_tokens: Tensor = sum_field()
    tokens: Tensor = sum_field()
    nonfinite: Tensor = sum_field()


def _tokens(x: Tensor, channel_dim: int) -> Tensor:
    """``x`` as ``(tokens, C)``, a view where the layout allows (no copy, no dtype change)."""
    if x.ndim == 0 or not -x.ndim <= channel_dim < x.ndim:
        raise ValueError(f"outlier_sums: channel_dim={channel_dim} is out of range for shape {tuple(x.shape)}.")
    if x.shape[channel_dim] == 0:
        raise ValueError(f"outlier_sums: an input of shape {tuple(x.shape)} has no channel on dim {channel_dim}.")
    t = x.detach().movedim(channel_dim, -1)  # (..., C)
    return t.reshape(-1, t.shape[-1])  # (T, C)


def outlier_sums(x: Tensor, channel_dim: int = -1, *, chunk_entries: int = 1 << 24) -> OutlierSums:
    """Reduce one norm-layer input to :class:`OutlierSums` (see the module docstring).

    Args:
        x: the input, any floating dtype and layout; ``C = x.shape[channel_dim] >= 1``.
        channel_dim: the channel dim (``-1`` channels-last, ``1`` channels-first).
        chunk_entries: tokens are reduced in chunks of about this many entries, which bounds
            the float32 temporaries (a few chunk-sized copies) on a large activation.

    Returns:
        The statistics, in the compute dtype on ``x``'s device (no host synchronisation).
    """
    tokens = _tokens(x, channel_dim)  # (T, C)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    step = max(1, chunk_entries // tokens.shape[1])
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        if tokens.shape[0] <= step:
            return _chunk_sums(tokens.to(dtype))
        total = OutlierSums.zeros(dtype=dtype, device=x.device)
        for start in range(0, tokens.shape[0], step):
            total = total + _chunk_sums(tokens[start:start + step].to(dtype))
        return total


def _chunk_sums(t: Tensor) -> OutlierSums:
    """:func:`outlier_sums` of ``t (T, C)``, already in the compute dtype."""
    n_tokens, c = t.shape
    a = t.abs()
    overflow = (a >= FP16_SQUARE_OVERFLOW).sum()  # ±Inf counts; NaN compares False
    finite = a < math.inf  # NaN and ±Inf are not
    nonfinite = n_tokens * c - finite.sum()
    zero = t.new_zeros(())
    t, a = torch.where(finite, t, zero), torch.where(finite, a, zero)
    peak = a.amax(dim=-1, keepdim=True)  # (T, 1)
    live = peak > 0  # tokens with a non-zero channel
    u = t / torch.where(live, peak, torch.ones_like(peak))  # (T, C): |u| <= 1, max |u| = 1 where live
    sq = u * u
    rms_share = torch.where(live, 1.0 / sq.sum(-1, keepdim=True).clamp_min(1.0), 1.0 / c)  # (T, 1); sum >= 1 where live
    even = c % 2 == 0
    if even:
        r = sq.unflatten(-1, (c // 2, 2)).sum(-1).sqrt()  # (T, P)
        # sum_i r_i >= max_i r_i >= 1 where live
        mrs = torch.where(live, r.amax(-1, keepdim=True) / r.sum(-1, keepdim=True).clamp_min(1.0), 2.0 / c)  # (T, 1)
    median = _median(u.abs())  # (T,)
    ratio = torch.where(median > 0, 1.0 / median.clamp_min(1.0 / RATIO_CAP), RATIO_CAP)
    ratio = torch.where(live.squeeze(-1), ratio, 1.0)  # (T,): a zero token is even
    d = u - u.mean(-1, keepdim=True)  # (T, C)
    d2 = d * d
    m2, m4 = d2.mean(-1), (d2 * d2).mean(-1)  # (T,)
    has_kurtosis = m2 > 0  # not all channels equal (exactly 0 then: equal channels scale to exactly ±1)
    tiny = torch.finfo(t.dtype).tiny
    kurtosis = torch.where(has_kurtosis, m4 / m2.clamp_min(tiny) / m2.clamp_min(tiny), 0.0)  # (T,); no m2^2 underflow

    def largest(v: Tensor) -> Tensor:
        return v.amax() if v.numel() else zero

    def count(v: int) -> Tensor:
        return torch.full((), float(v), dtype=t.dtype, device=t.device)  # a fill, not a host-to-device copy

    return OutlierSums(
        absmax=largest(peak),
        rms_share=largest(rms_share),
        mrs_share=largest(mrs) if even else zero,
        outlier_ratio=largest(ratio),
        overflow=overflow.to(t.dtype),
        entries=count(n_tokens * c),
        kurtosis_sum=kurtosis.sum(),
        kurtosis_tokens=has_kurtosis.sum().to(t.dtype),
        mrs_tokens=count(n_tokens if even else 0),
        tokens=count(n_tokens),
        nonfinite=nonfinite.to(t.dtype),
    )


def _median(a: Tensor) -> Tensor:
    """The median of each row of ``a (T, C)`` (of an even count: the mean of the two middle
    values), from the ``C//2 + 1`` smallest: a partial selection, about 3x faster than a sort."""
    c = a.shape[-1]
    smallest = a.topk(c // 2 + 1, dim=-1, largest=False, sorted=False).values  # (T, C//2 + 1)
    if c % 2:
        return smallest.amax(-1)  # the middle value
    return smallest.topk(2, dim=-1).values.mean(-1)  # the two middle values


#: name -> formula, ``outlier/all`` pooling (the worst layer; ``nonfinite`` summed) and the count it
#: needs (``mrs_share``: an even channel count; ``kurtosis``: a token of unequal channels). A layer that
#: saw no token (``tokens == 0``) has none of them.
FIGURES: dict[str, Figure] = {
    "absmax": Figure(lambda s: s.absmax, "max"),
    "rms_share": Figure(lambda s: s.rms_share, "max"),
    "mrs_share": Figure(lambda s: s.mrs_share, "max", needs="mrs_tokens"),
    "outlier_ratio": Figure(lambda s: s.outlier_ratio, "max"),
    "x2_over_fp16_frac": Figure(lambda s: s.overflow / s.entries.clamp_min(1), "max"),
    "kurtosis": Figure(lambda s: s.kurtosis_sum / s.kurtosis_tokens.clamp_min(1), "max", needs="kurtosis_tokens"),
    "nonfinite": Figure(lambda s: s.nonfinite, "sum"),
}
#: The figures :data:`FIGURES` gives, in their documented order.
FIGURE_NAMES: tuple[str, ...] = tuple(FIGURES)

