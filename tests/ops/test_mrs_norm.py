"""``lightning_mrs.mrs_norm`` (``backend="auto"``) against the independent float64 reference of
docs/method.md over ranks 1 to 5 and odd sizes, half precision computed in fp32, and ``mrs_scale``.

Layouts are in ``test_layout_matrix.py``, random shapes and strides in ``test_fuzz.py``,
each backend in ``test_backends.py`` and the argument checks in ``test_validation.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_mrs import mrs_norm, mrs_scale
from helpers.reference import mrs_norm_ref

# (atol, rtol) of the output, per input dtype; half dtypes are rounded once on output.
TOLS = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = list(TOLS)

CHANNELS_LAST_SHAPES = [(6,), (3, 10), (2, 5, 18), (7, 3, 2), (1, 1, 64)]
CHANNELS_FIRST_SHAPES = [(2, 6), (3, 8, 5), (2, 10, 7, 9), (2, 6, 3, 4, 5), (1, 4, 1, 1), (5, 2, 3)]


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLS[dtype]
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CHANNELS_LAST_SHAPES)
@pytest.mark.parametrize("affine", [False, True])
def test_channels_last_matches_reference(shape, dtype, affine):
    torch.manual_seed(0)
    x = (3 * torch.randn(shape, dtype=torch.float64)).to(dtype)
    w = torch.rand(shape[-1] // 2, dtype=torch.float64).add(0.5).to(dtype) if affine else None
    _check(mrs_norm(x, w), mrs_norm_ref(x, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", CHANNELS_FIRST_SHAPES)
@pytest.mark.parametrize("spatial", [False, True])
def test_channels_first_matches_reference(shape, dtype, spatial):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    w = torch.randn(shape[1] // 2, dtype=torch.float64).to(dtype)
    y = mrs_norm(x, w, channel_dim=1, spatial=spatial)
    _check(y, mrs_norm_ref(x, w, channel_dim=1, spatial=spatial), dtype)


def test_spatial_modes_differ_and_share_scale():
    x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    per_pos = mrs_scale(x, channel_dim=1)
    per_sample = mrs_scale(x, channel_dim=1, spatial=True)
    assert per_pos.shape == (2, 1, 3, 3)
    assert per_sample.shape == (2, 1, 1, 1)
    # the per-sample S is the mean of the per-position ones (all positions hold P phasors)
    torch.testing.assert_close(per_sample.flatten(), per_pos.flatten(1).mean(1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_computed_in_fp32(dtype):
    torch.manual_seed(3)
    x = torch.randn(64, 256).to(dtype)
    y = mrs_norm(x)
    # an fp32 computation rounded once is within one ulp of the exact result rounded; a
    # computation carried out in half precision drifts by several ulps over 128 phasors
    ulp = torch.finfo(dtype).eps
    expected = mrs_norm_ref(x).to(dtype)
    assert y.dtype == dtype
    torch.testing.assert_close(y, expected, atol=ulp * 1e-2, rtol=ulp)


def test_fp16_outlier_of_60000_stays_finite_and_correct():
    x = torch.randn(4, 64).half()
    x[:, 10] = 60000.0  # x^2 = 3.6e9 overflows fp16 (max 65504): RMSNorm's failure mode
    assert torch.isinf(x * x).any()
    w = torch.ones(32, dtype=torch.float16)
    y = mrs_norm(x, w)
    assert torch.isfinite(y).all()
    _check(y, mrs_norm_ref(x, w), torch.float16)
