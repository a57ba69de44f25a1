"""``lightning_mrs.attention_stats`` against a float64 softmax materialised by independent code.

The reference (:func:`helpers.reference.attention_ref`) takes the sampled queries from the
documented rule (restated here with Python ints), builds every logit of them with ``einsum``
in float64, and reads the figures straight from their definitions.
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch

from helpers.reference import attention_ref
from lightning_mrs.attention_stats import FIGURES as TABLE
from lightning_mrs.attention_stats import AttentionSums, attention_figures, attention_sums, per_head, query_sample
from lightning_mrs.sums import pool

FIGURES = ("logit_max", "entropy_mean", "entropy_min", "collapsed_frac", "q_norm_mean", "k_norm_mean")
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-5),
       torch.float16: (1e-5, 1e-5)}  # fp32 maths on the given values, whatever their dtype


def sampled_pairs(batch: int, length: int, max_queries: Optional[int]) -> list[tuple[int, int]]:
    """The (sample, position) pairs of the documented rule."""
    m = batch * length if max_queries is None else max_queries
    s = min(batch, m)
    p = min(length, m // s)
    return [(j * batch // s, (i * length // p + j) % length) for j in range(s) for i in range(p)]


def peaky(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, spread: float = 3.0) -> torch.Tensor:
    """Random entries with per-vector scales over ``exp(+-spread)``: some softmax rows collapse."""
    x = torch.randn(shape)
    return (x * torch.exp(spread * torch.rand(*shape[:-1], 1) - spread / 2)).to(dtype)


def figures(sums: AttentionSums) -> dict[str, float]:
    return {k: v.item() for k, v in attention_figures(sums).items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kv_heads,keys,max_queries", [
    ((2, 3, 5, 4), 3, 5, None),  # self attention, all queries
    ((3, 4, 7, 6), 2, 7, None),  # grouped-query: 2 key heads for 4 query heads
    ((4, 2, 9, 8), 2, 11, 10),  # cross attention (more keys), 4 samples x 2 positions
    ((5, 1, 3, 2), 1, 3, 3),  # fewer wanted queries than samples: 3 samples, one position each
    ((2, 2, 6, 4), 1, 6, 7),  # 2 samples x 3 positions (7 // 2)
])
def test_figures_match_materialised_softmax(dtype: torch.dtype, shape: tuple, kv_heads: int, keys: int,
                                            max_queries: Optional[int]) -> None:
    b, h, n, d = shape
    q, k = peaky(shape, dtype), peaky((b, kv_heads, keys, d), dtype)
    scale = d**-0.5
    sums = attention_sums(q, k, scale, max_queries=max_queries)
    ref = attention_ref(q, k, scale, sampled_pairs(b, n, max_queries))
    got = figures(sums)
    atol, rtol = TOL[dtype]
    for name in FIGURES:
        assert got[name] == pytest.approx(ref[name], rel=rtol, abs=atol), name
    assert sums.queries.item() == len(sampled_pairs(b, n, max_queries))


def test_reference_sees_the_collapse_and_the_sampling() -> None:
    """The figures above are not trivial: some rows collapse, and sampling changes them."""
    q, k = peaky((4, 2, 9, 8)), peaky((4, 2, 11, 8))
    full = attention_ref(q, k, 8**-0.5, sampled_pairs(4, 9, None))
    part = attention_ref(q, k, 8**-0.5, sampled_pairs(4, 9, 10))
    assert 0 < full["collapsed_frac"] < 1
    assert full["entropy_mean"] != pytest.approx(part["entropy_mean"], rel=1e-3)


def test_autocast_does_not_lower_the_precision() -> None:
    q, k = peaky((2, 2, 6, 8)), peaky((2, 2, 6, 8))
    plain = figures(attention_sums(q, k, 0.35))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = figures(attention_sums(q, k, 0.35))
    assert cast == plain


@pytest.mark.parametrize("layout", ["BNHD", "(BH)ND", "BN(HD)"])
def test_layouts_give_the_figures_of_the_per_head_tensors(layout: str) -> None:
    q, k = peaky((3, 4, 5, 6)), peaky((3, 2, 5, 6))  # (B, H, N, D); 2 key heads (GQA)
    expected = figures(attention_sums(q, k, 0.4))
    if layout == "BNHD":
        got = attention_sums(q.transpose(1, 2), k.transpose(1, 2), 0.4, layout=layout)
    elif layout == "BN(HD)":  # OLMo 2: the whole projection, (B, N, H*D)
        got = attention_sums(q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2), 0.4, layout=layout,
                             head_dim=6)
    else:
        k = k.repeat_interleave(2, dim=1)  # "(BH)ND" folds one head count into B
        expected = figures(attention_sums(q, k, 0.4))
        got = attention_sums(q.reshape(12, 5, 6), k.reshape(12, 5, 6), 0.4, layout=layout, num_heads=4)
    assert figures(got) == pytest.approx(expected, rel=1e-6)


def test_sums_add_over_calls_and_parts_of_a_batch() -> None:
    """Two halves of a batch add up to the whole (micro-batches, DDP ranks)."""
    q, k = peaky((6, 2, 5, 4)), peaky((6, 2, 5, 4))
    whole = attention_sums(q, k, 0.5)
    halves = attention_sums(q[:3], k[:3], 0.5) + attention_sums(q[3:], k[3:], 0.5)
    assert figures(halves) == pytest.approx(figures(whole), rel=1e-6)
    assert halves.logit_max.item() == pytest.approx(whole.logit_max.item(), rel=1e-6)
    empty = AttentionSums.zeros(2)
    assert figures(empty + whole) == pytest.approx(figures(whole), rel=1e-6)  # float64 + float32


def test_zeros_give_uniform_attention_not_nan() -> None:
    q, k = torch.zeros(2, 3, 4, 6), torch.zeros(2, 3, 7, 6)
    got = figures(attention_sums(q, k, 1.0))
    uniform = pytest.approx(math.log(7))
    assert got == {"logit_max": 0.0, "entropy_mean": uniform, "entropy_min": uniform, "collapsed_frac": 0.0,
                   "q_norm_mean": 0.0, "k_norm_mean": 0.0}
    one_key = figures(attention_sums(torch.randn(2, 3, 4, 6), torch.randn(2, 3, 1, 6), 1.0))
    assert one_key["entropy_mean"] == 0.0 and one_key["collapsed_frac"] == 1.0  # weight 1 on the only key


@pytest.mark.parametrize("batch,length,max_queries", [(8, 5, None), (8, 5, 40), (8, 5, 100), (8, 5, 20), (8, 5, 3),
                                                       (3, 197, 256), (128, 197, 256), (1, 1, 1)])
def test_query_sample_is_the_documented_rule(batch: int, length: int, max_queries: Optional[int]) -> None:
    samples, positions = query_sample(batch, length, max_queries)
    pairs = [(b, n) for b, row in zip(samples.tolist(), positions.tolist()) for n in row]
    assert pairs == sampled_pairs(batch, length, max_queries)
    assert len(set(pairs)) == len(pairs) <= (max_queries or batch * length)
    if max_queries is None or max_queries >= batch * length:
        assert set(pairs) == {(b, n) for b in range(batch) for n in range(length)}


def test_aggregate_takes_the_worst_layer_and_the_mean() -> None:
    rows = [{name: float(i + 1) * (j + 1) for j, name in enumerate(FIGURES)} for i in range(3)]
    del rows[0]["q_norm_mean"]  # a layer without QK-norm has no norm figures
    agg = pool(TABLE, rows)
    assert agg["logit_max"] == 3.0 and agg["collapsed_frac"] == 12.0  # worst layer
    assert agg["entropy_mean"] == 4.0 and agg["entropy_min"] == 6.0  # mean of 1,2,3 times 2 or 3
    assert agg["q_norm_mean"] == pytest.approx((2 + 3) * 5 / 2)  # mean over the layers that have it


@pytest.mark.parametrize("call,match", [
    (lambda: per_head(torch.zeros(2, 3, 4), "BHND"), "must be 4-d"),
    (lambda: per_head(torch.zeros(2, 3, 4, 5), "HNBD"), r"not one of \['BHND', 'BNHD', '\(BH\)ND', 'BN\(HD\)'\]"),
    (lambda: per_head(torch.zeros(5, 3, 4), "(BH)ND", 2), "heads=2"),
    (lambda: per_head(torch.zeros(2, 3, 20), "BN(HD)", head_dim=8), "head_dim=8"),
    (lambda: attention_sums(torch.zeros(2, 4, 3, 8), torch.zeros(2, 3, 3, 8), 1.0), "key heads must divide"),
    (lambda: attention_sums(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 6), 1.0), "do not fit"),
])
def test_bad_input(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
