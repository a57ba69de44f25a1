"""Property-based fuzz of ``mrs_norm`` (``backend="auto"``) against the float64 reference.

Hypothesis draws the rank, the sizes (0 and 1 included), the channel dim, ``spatial``, the
dtype, the weight (and its dtype, as under autocast) and a memory layout: a storage order
(any permutation of the dims), strided slices and stride-0 expanded dims. A fixed budget of
derandomised examples keeps the default run short and reproducible; a failure prints the
drawn case.
"""

from __future__ import annotations

from typing import Optional

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import Tensor

from lightning_mrs import mrs_norm
from lightning_mrs.ops import which_backend
from helpers.checks import assert_matches_reference, grads

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Tensor, Optional[Tensor], Tensor, int, bool]:
    """``(x, w, gy, channel_dim, spatial)`` with ``x`` in a drawn layout."""
    ndim = draw(st.sampled_from((3, 2, 4, 1)))  # sampled_from: each rank about as often
    channel_dim = draw(st.integers(-ndim, ndim - 1))
    dim = channel_dim % ndim
    spatial = ndim >= 2 and dim != 0 and draw(st.booleans())
    shape = [2 * draw(st.integers(1, 6)) if d == dim else draw(st.sampled_from((3, 1, 2, 4, 5))) for d in range(ndim)]
    if ndim > 1 and dim != 0 and draw(st.sampled_from((False,) * 7 + (True,))):
        shape[0] = 0  # now and then an empty batch
    shape = tuple(shape)
    dtype = draw(st.sampled_from(FLOATS))
    others = [d for d in range(ndim) if d != dim]
    order = draw(st.one_of(  # the storage order, outermost first
        st.just(list(range(ndim))), st.just(others + [dim]), st.permutations(range(ndim))))
    # mostly dense, so that every backend auto picks is drawn; else slices or stride-0 dims
    sliced, expand = draw(st.sampled_from((False, False, False, True))), draw(st.sampled_from((False, False, True)))
    steps = [draw(st.sampled_from((1, 2, 3))) if sliced and d != dim else 1 for d in range(ndim)]
    expanded = [expand and d != dim and shape[d] > 1 and steps[d] == 1 and draw(st.booleans()) for d in range(ndim)]
    seed = draw(st.integers(0, 2**16))

    g = torch.Generator().manual_seed(seed)
    storage = [1 if expanded[d] else shape[d] * steps[d] for d in range(ndim)]
    base = (3 * torch.randn([storage[d] for d in order], generator=g, dtype=torch.float64)).to(dtype)
    x = base.permute([order.index(d) for d in range(ndim)])  # the dims back in logical order
    x = x[tuple(slice(None, None, step) for step in steps)].expand(shape)
    assert x.shape == shape

    weight_dtype = draw(st.sampled_from((None, dtype, torch.float32)))
    w = None
    if weight_dtype is not None:
        w = (torch.rand(shape[dim] // 2, generator=g, dtype=torch.float64) + 0.5).to(weight_dtype)
    gy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, gy, channel_dim, spatial


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_auto_backend_matches_reference(case: tuple[Tensor, Optional[Tensor], Tensor, int, bool]) -> None:
    x, w, gy, channel_dim, spatial = case
    event(f"backend {which_backend(x, channel_dim=channel_dim, spatial=spatial)}")  # --hypothesis-show-statistics
    event(f"{x.ndim}-d {str(x.dtype)[6:]}")
    got = grads(lambda a, b: mrs_norm(a, b, channel_dim=channel_dim, spatial=spatial), x, w, gy)
    assert_matches_reference(got, x, w, gy, channel_dim, spatial)
