"""Attention statistics from captured queries and keys: the maths behind ``AttentionMonitor``.

Needs only torch. Fused attention (``scaled_dot_product_attention``) never materialises its
logits, so they are recomputed here from the per-head ``q`` and ``k`` that enter them (the
outputs of an attention layer's ``q_norm``/``k_norm``, see
:mod:`lightning_mrs.swap.attention`): ``logits = scale * q . k`` for a *sample* of the
queries against *all* keys of the same sample and head, in float32 (whatever the input dtype
or autocast), then the softmax over the keys.

Which queries (:func:`query_sample`): a query is one position of one sample (a batch entry;
windowed attention folds windows into the batch), seen by every head. With ``B`` samples of
``N`` queries and at most ``m`` queries wanted: ``s = min(B, m)`` evenly spaced samples
``b_j = floor(j B / s)``, and in the ``j``-th of them ``p = min(N, floor(m / s))`` evenly spaced
positions shifted by ``j``: ``(floor(i N / p) + j) mod N``, ``i < p`` (the shift keeps the
sample from always landing on the same tokens, e.g. a class token). ``m >= B N`` (or
``None``) takes every query.

Per call (:func:`attention_sums`) the figures reduce to :class:`AttentionSums`, which add
across calls, micro-batches and ranks (sums add, ``logit_max`` takes the larger);
:func:`attention_figures` turns them into the logged figures:

* ``logit_max``: the largest ``|scale * q . k|``;
* ``entropy_mean``: the softmax entropy ``-sum_j p_j ln p_j`` (nats) of each attention row
  (one per query and head), averaged over heads and queries;
* ``entropy_min``: the mean entropy of the lowest head (per-head means over the queries);
* ``collapsed_frac``: the share of attention rows whose largest weight exceeds a threshold;
* ``q_norm_mean`` / ``k_norm_mean``: the mean L2 norm (over ``head_dim``) of the per-head
  query vectors of the sample and of the key vectors they attend to.

Not included in the logits: attention masks, additive position biases and rotary embeddings
applied after ``k_norm`` (what the hooks see is ``q . k`` alone). NaN/Inf in q or k give NaN/Inf
figures.

Example:
    >>> q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)  # (B, heads, N, head_dim)
    >>> sums = attention_sums(q, k, scale=0.5)
    >>> figures = attention_figures(sums)
    >>> sorted(figures)
    ['collapsed_frac', 'entropy_mean', 'entropy_min', 'k_norm_mean', 'logit_max', 'q_norm_mean']
    >>> bool(figures["entropy_mean"] <= torch.log(torch.tensor(5.0)))
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_mrs.sums import Figure, Sums, max_field, sum_field

__all__ = [
    "FIGURES",
    "LAYOUTS",
    "AttentionSums",
    "attention_figures",
    "attention_sums",
    "per_head",
    "query_sample",
]

#: The q/k layouts :func:`per_head` understands (:attr:`lightning_mrs.swap.AttentionInfo.layout`).
LAYOUTS: tuple[str, ...] = ("BHND", "BNHD", "(BH)ND", "BN(HD)")


def per_head(t: Tensor, layout: str = "BHND", num_heads: Optional[int] = None, head_dim: Optional[int] = None,
             ) -> Tensor:
    """A ``(B, heads, N, head_dim)`` view of a query or key tensor in ``layout``.

    Args:
        t: the tensor ``q_norm``/``k_norm`` returned.
        layout: one of :data:`LAYOUTS`.
        num_heads: the heads folded into the first dim (``"(BH)ND"`` only).
        head_dim: the width of a head folded into the last dim (``"BN(HD)"`` only: OLMo 2's
            QK-norms see the whole projection).
    """
    if layout == "BN(HD)":
        if t.ndim != 3 or head_dim is None or t.shape[-1] % head_dim:
            raise ValueError(f"per_head: a (B, N, heads*D) tensor with head_dim={head_dim} cannot have shape "
                             f"{tuple(t.shape)}.")
        return t.unflatten(-1, (-1, head_dim)).transpose(1, 2)  # (B, H, N, D)
    if layout == "(BH)ND":
        if t.ndim != 3 or num_heads is None or t.shape[0] % num_heads:
            raise ValueError(f"per_head: a (B*heads, N, D) tensor with heads={num_heads} cannot have shape "
                             f"{tuple(t.shape)}.")
        return t.unflatten(0, (-1, num_heads))  # (B, H, N, D)
    if layout not in LAYOUTS:
        raise ValueError(f"per_head: layout={layout!r} is not one of {list(LAYOUTS)}.")
    if t.ndim != 4:
        raise ValueError(f"per_head: a {layout} tensor must be 4-d, got shape {tuple(t.shape)}.")
    return t.transpose(1, 2) if layout == "BNHD" else t  # (B, H, N, D)


@lru_cache(maxsize=256)
def query_sample(batch: int, length: int, max_queries: Optional[int], device: torch.device = torch.device("cpu"),
                 ) -> tuple[Tensor, Tensor]:
    """The sampled queries (see the module docstring): ``(samples (s,), positions (s, p))``.

    Example:
        >>> samples, positions = query_sample(4, 5, 6)
        >>> samples.tolist(), positions.tolist()
        ([0, 1, 2, 3], [[0], [1], [2], [3]])
        >>> query_sample(2, 5, 6)[1].tolist()  # 3 positions in each of the 2 samples
        [[0, 1, 3], [1, 2, 4]]
    """
    if batch < 1 or length < 1:
        raise ValueError(f"query_sample: need at least one sample and one query, got {batch} x {length}.")
    m = batch * length if max_queries is None else max(int(max_queries), 1)
    s = min(batch, m)
    p = min(length, m // s)
    samples = torch.arange(s, device=device) * batch // s  # (s,)
    shift = torch.arange(s, device=device).unsqueeze(1)  # (s, 1)
    positions = (torch.arange(p, device=device) * length // p + shift) % length  # (s, p)
    return samples, positions


@dataclass(frozen=True)
class AttentionSums(Sums):
    """One layer's attention sums (see the module docstring); they add with ``+``.

    Attributes:
        entropy: ``(H,)`` summed row entropy (nats) of each head over the sampled queries.
        queries: ``()`` sampled queries (each one an attention row in every head).
        collapsed: ``()`` attention rows (queries x heads) whose largest weight exceeds the threshold.
        q_norm: ``()`` summed L2 norm of the sampled per-head query vectors (queries x heads).
        k_norm: ``()`` summed L2 norm of the per-head key vectors they attend to.
        keys: ``()`` key vectors in ``k_norm`` (keys x key heads).
        logit_max: ``()`` the largest ``|scale * q . k|`` (0 when empty); taken with max, not added.

    Example:
        >>> q = k = torch.randn(1, 2, 3, 4)  # (batch, heads, tokens, head_dim)
        >>> total = AttentionSums.zeros(2) + attention_sums(q, k, 0.5) + attention_sums(q, k, 0.5)
        >>> total.queries.item(), total.entropy.shape
        (6.0, torch.Size([2]))
    """

    entropy: Tensor = sum_field(vector=True)
    queries: Tensor = sum_field()
    collapsed: Tensor = sum_field()
    q_norm: Tensor = sum_field()
    k_norm: Tensor = sum_field()
    keys: Tensor = sum_field()
    logit_max: Tensor = max_field()

    @property
    def num_heads(self) -> int:
        return self.entropy.shape[0]


def attention_sums(
    q: Tensor,
    k: Tensor,
    scale: float,
    *,
    layout: str = "BHND",
    num_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    max_queries: Optional[int] = None,
    collapse_threshold: float = 0.99,
) -> AttentionSums:
    """Reduce one attention call's queries and keys to :class:`AttentionSums` (float32 maths).

    Args:
        q: the queries that enter the logits, in ``layout``.
        k: the keys, in ``layout``; fewer heads than ``q`` (grouped-query attention) when they
            divide its heads: query head ``h`` attends with key head ``h // (H_q / H_k)``.
        scale: the logits' factor of ``q . k``.
        layout: one of :data:`LAYOUTS`.
        num_heads: the query heads (needed for ``"(BH)ND"``, which folds them into dim 0).
        head_dim: the width of a head (needed for ``"BN(HD)"``, which folds the heads into the last dim).
        max_queries: at most this many queries (:func:`query_sample`); ``None`` takes all.
        collapse_threshold: a row is collapsed when its largest weight exceeds this.

    Example:
        >>> q = k = torch.zeros(2, 4, 8, 16)  # (batch, heads, tokens, head_dim): every logit is 0
        >>> sums = attention_sums(q, k, scale=16 ** -0.5)
        >>> sums.queries.item(), sums.logit_max.item()
        (16.0, 0.0)
        >>> torch.allclose(sums.entropy / sums.queries, torch.tensor(8.0).log())  # uniform rows: ln 8 nats
        True
    """
    qh = per_head(q.detach(), layout, num_heads, head_dim)  # (B, H, Nq, D)
    kh = per_head(k.detach(), layout, num_heads, head_dim)  # (B, Hk, Nk, D)
    (b, h, n, d), hk = qh.shape, kh.shape[1]
    if kh.shape[0] != b or kh.shape[-1] != d or h % hk:
        raise ValueError(f"attention_sums: keys of shape {tuple(kh.shape)} do not fit queries of shape "
                         f"{tuple(qh.shape)} (B, heads, N, head_dim); key heads must divide query heads.")
    samples, positions = query_sample(b, n, max_queries, qh.device)  # (s,), (s, p)
    s, p = positions.shape
    with torch.no_grad(), torch.autocast(qh.device.type, enabled=False):
        qs = qh[samples.unsqueeze(1), :, positions].float()  # (s, p, H, D)
        ks = (kh if s == b else kh[samples]).float()  # (s, Hk, Nk, D)
        qs = qs.permute(0, 2, 1, 3).unflatten(1, (hk, h // hk))  # (s, Hk, G, p, D)
        logits = (qs * scale) @ ks.unsqueeze(2).transpose(-1, -2)  # (s, Hk, G, p, Nk)
        logits = logits.flatten(1, 2)  # (s, H, p, Nk); head h = key head h // G
        logp = logits.log_softmax(dim=-1)
        weights = logp.exp()
        entropy = -(weights * logp).sum(dim=-1)  # (s, H, p)
        return AttentionSums(
            entropy=entropy.sum(dim=(0, 2)),  # (H,)
            queries=torch.full((), float(s * p), device=qh.device),  # a fill, not a host-to-device copy
            collapsed=(weights.amax(dim=-1) > collapse_threshold).sum().float(),
            q_norm=torch.linalg.vector_norm(qs, dim=-1).sum(),
            k_norm=torch.linalg.vector_norm(ks, dim=-1).sum(),
            keys=torch.full((), float(ks.shape[0] * ks.shape[1] * ks.shape[2]), device=qh.device),
            logit_max=logits.abs().amax() if logits.numel() else logits.new_zeros(()),
        )


def _rows(sums: AttentionSums) -> Tensor:
    return (sums.queries * sums.num_heads).clamp_min(1)  # attention rows: queries x heads


#: name -> formula and ``attention/all`` pooling: the worst layer's ``logit_max`` and ``collapsed_frac``,
#: the mean over layers of the rest. Meaningless when ``queries == 0`` (nothing captured): such layers are skipped.
FIGURES: dict[str, Figure] = {
    "logit_max": Figure(lambda s: s.logit_max, "max"),
    "entropy_mean": Figure(lambda s: s.entropy.sum() / _rows(s)),
    "entropy_min": Figure(lambda s: (s.entropy / s.queries.clamp_min(1)).min()),
    "collapsed_frac": Figure(lambda s: s.collapsed / _rows(s), "max"),
    "q_norm_mean": Figure(lambda s: s.q_norm / _rows(s)),
    "k_norm_mean": Figure(lambda s: s.k_norm / s.keys.clamp_min(1)),
}


def attention_figures(sums: AttentionSums) -> dict[str, Tensor]:
    """The figures of :data:`FIGURES` (0-d tensors on the sums' device) from ``sums``.

    Example:
        >>> q = k = torch.zeros(2, 4, 8, 16)  # uniform attention over 8 keys
        >>> figures = attention_figures(attention_sums(q, k, scale=0.25))
        >>> round(figures["entropy_mean"].item(), 4), figures["collapsed_frac"].item()
        (2.0794, 0.0)
    """
    return {name: figure.formula(sums) for name, figure in FIGURES.items()}
