"""``lightning_mrs.outlier_stats`` against the direct float64 computation of ``helpers.outliers``:
odd shapes, layouts, half inputs, zeros, NaN/Inf, huge values, splits, property-based fuzzing."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.outliers import outlier_ref
from lightning_mrs.outlier_stats import FIGURE_NAMES, FIGURES, FP16_SQUARE_OVERFLOW, OutlierSums, outlier_sums
from lightning_mrs.sums import pool
from lightning_mrs.stats import RATIO_CAP

#: (rel, abs) of a figure computed from a float32/float64 input against the float64 reference
TOLS = {torch.float64: (1e-9, 1e-12), torch.float32: (2e-5, 1e-6)}


def figures(x: torch.Tensor, channel_dim: int = -1, **kw) -> dict[str, float]:
    """The figures the monitor would log for one input (the undefined ones left out)."""
    s = outlier_sums(x, channel_dim, **kw)
    return {f: figure.formula(s).item() for f, figure in FIGURES.items() if s.tokens.item() > 0
            and (figure.needs is None or getattr(s, figure.needs).item() > 0)}


def assert_matches(got: dict[str, float], ref: dict[str, float], rel: float, abs: float) -> None:
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert got[name] == pytest.approx(value, rel=rel, abs=abs), name


# (shape, channel_dim): tokens channels-last, channels-first images, odd widths, one channel
SHAPES = {
    "tokens": ((3, 7, 16), -1),
    "odd_channels": ((4, 5, 9), -1),
    "one_channel": ((6, 1), -1),
    "one_phasor": ((5, 2), -1),
    "nchw": ((2, 6, 5, 3), 1),
    "nchw_odd": ((2, 7, 3, 3), 1),
    "ncl": ((3, 4, 11), 1),
    "nc": ((9, 6), 1),
    "middle_dim": ((2, 3, 8, 2), 2),
}


@pytest.mark.parametrize("case", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_float64_reference(case: str, dtype: torch.dtype) -> None:
    shape, dim = SHAPES[case]
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    x.select(dim, 0).mul_(60.0)  # a planted outlier channel (and some entries over 256)
    ref = outlier_ref(x, dim)
    assert_matches(figures(x, dim), ref, *TOLS[dtype])
    assert ("mrs_share" in ref) == (shape[dim] % 2 == 0) and ("kurtosis" in ref) == (shape[dim] > 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_computed_in_float32(dtype: torch.dtype) -> None:
    """The figures of the half-precision values themselves, as float64 gives them (no half maths)."""
    x = (torch.randn(4, 9, 32, dtype=torch.float64) * 100).to(dtype)  # squares overflow fp16
    got = figures(x)
    assert_matches(got, outlier_ref(x), *TOLS[torch.float32])
    assert 0 < got["x2_over_fp16_frac"] < 1


def test_non_contiguous_layouts() -> None:
    x = torch.randn(3, 8, 5, 7, dtype=torch.float64)
    ref = outlier_ref(x, 1)
    assert_matches(figures(x.contiguous(memory_format=torch.channels_last), 1), ref, *TOLS[torch.float64])
    assert_matches(figures(x.transpose(1, 3), 3), ref, *TOLS[torch.float64])
    strided = torch.randn(6, 16, dtype=torch.float64)[::2, ::2]  # (3, 8), strides (32, 2)
    assert_matches(figures(strided), outlier_ref(strided), *TOLS[torch.float64])


def test_zeros_give_documented_neutral_values() -> None:
    got = figures(torch.zeros(3, 8))
    assert got == {"absmax": 0.0, "rms_share": 1 / 8, "mrs_share": 1 / 4, "outlier_ratio": 1.0,
                   "x2_over_fp16_frac": 0.0, "nonfinite": 0.0}  # no kurtosis: no token has unequal channels
    mixed = torch.zeros(4, 6, dtype=torch.float64)
    mixed[1] = torch.tensor([3.0, 0, 0, 0, 0, 0])  # a zero median under a non-zero maximum
    mixed[2] = torch.arange(6.0)
    got = figures(mixed)
    assert_matches(got, outlier_ref(mixed), *TOLS[torch.float64])
    assert got["outlier_ratio"] == RATIO_CAP and got["rms_share"] == 1.0
    assert all(math.isfinite(v) for v in got.values())


def test_equal_channels_have_no_kurtosis_but_do_not_dilute_it() -> None:
    x = torch.tensor([[0.1] * 6, [-2.0] * 6, [1.0, -1.0, 1.0, -1.0, 1.0, -1.0], [1.0, 0, 0, 0, 0, 0]])
    s = outlier_sums(x)
    assert s.kurtosis_tokens.item() == 2  # the two constant tokens are left out
    assert figures(x)["kurtosis"] == pytest.approx(outlier_ref(x)["kurtosis"], rel=1e-6)
    assert figures(x)["kurtosis"] == pytest.approx((1.0 + 4.2) / 2, rel=1e-6)  # alternating +-1: 1; one spike in 6: 4.2


def test_nonfinite_entries_are_counted_and_read_as_zero() -> None:
    x = torch.randn(5, 8, dtype=torch.float64)
    x[0, 1], x[2, 3], x[3, 0] = math.nan, math.inf, -math.inf
    got = figures(x)
    assert got["nonfinite"] == 3 and got["x2_over_fp16_frac"] == pytest.approx(2 / 40)  # +-Inf overflow, NaN not
    assert_matches(got, outlier_ref(x), *TOLS[torch.float64])
    assert all(math.isfinite(v) for v in got.values())


def test_huge_and_tiny_values_stay_finite() -> None:
    """Float32 squares of 1e30 overflow and of 1e-30 underflow; the per-token scaling avoids both."""
    x = torch.tensor([[1e30, 1e29, -1e29, 0.0], [1e-30, 3e-30, 0.0, -2e-30], [1e-42, 0.0, 0.0, 0.0]])
    got = figures(x)
    assert all(math.isfinite(v) for v in got.values())
    ref = outlier_ref(x)
    assert_matches({k: v for k, v in got.items() if k != "absmax"}, {k: v for k, v in ref.items() if k != "absmax"},
                   *TOLS[torch.float32])
    assert got["absmax"] == pytest.approx(1e30, rel=1e-6)


def test_fp16_overflow_threshold_is_float16s_own() -> None:
    """Every float16 value from 200 to 300: the count is that of ``x * x`` computed in float16."""
    x = torch.arange(200.0, 300.0, 0.125).half().unique()  # (n,)
    expected = torch.isinf(x * x).sum().item()
    assert expected == (x >= 256).sum().item()  # 255.875^2 = 65472 is still finite
    s = outlier_sums(x.unsqueeze(0))
    assert s.overflow.item() == expected
    assert FP16_SQUARE_OVERFLOW == pytest.approx(255.968, abs=1e-3)


def test_chunks_and_splits_add_up_to_one_call() -> None:
    x = torch.randn(37, 10, dtype=torch.float64) * torch.rand(37, 1, dtype=torch.float64) * 50
    whole = outlier_sums(x)
    chunked = outlier_sums(x, chunk_entries=30)  # 3 tokens a chunk
    split = outlier_sums(x[:20]) + outlier_sums(x[20:])
    for other in (chunked, split):
        for name in OutlierSums.reduced_by("max"):
            assert getattr(other, name).item() == getattr(whole, name).item(), name
        for name in OutlierSums.reduced_by("sum"):
            assert getattr(other, name).item() == pytest.approx(getattr(whole, name).item(), rel=1e-12), name


def test_bad_channel_dim() -> None:
    with pytest.raises(ValueError, match="channel_dim=2 is out of range for shape"):
        outlier_sums(torch.ones(3, 4), 2)
    with pytest.raises(ValueError, match="no channel on dim"):
        outlier_sums(torch.ones(3, 0))


def test_aggregate_takes_the_worst_layer_and_sums_nonfinite() -> None:
    rows = [{"absmax": 3.0, "mrs_share": 0.5, "nonfinite": 1.0}, {"absmax": 7.0, "nonfinite": 2.0}]
    assert pool(FIGURES, rows) == {"absmax": 7.0, "mrs_share": 0.5, "nonfinite": 3.0}
    assert set(FIGURE_NAMES) >= pool(FIGURES, rows).keys()


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 6), channels=st.integers(1, 9), scale=st.floats(1e-3, 1e4),
    spike=st.floats(0.0, 1e3), seed=st.integers(0, 2**16), zero_tokens=st.integers(0, 2),
)
def test_property_reference_bounds_and_scale_invariance(tokens: int, channels: int, scale: float, spike: float,
                                                        seed: int, zero_tokens: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens + zero_tokens, channels, generator=g, dtype=torch.float64)
    x[:zero_tokens] = 0.0
    x[:, -1] *= 1.0 + spike
    got = figures(x)
    ref = outlier_ref(x)
    assert_matches(got, ref, rel=1e-7, abs=1e-9)
    assert 1 / channels - 1e-12 <= got["rms_share"] <= 1 + 1e-12
    if channels % 2 == 0:
        assert 2 / channels - 1e-12 <= got["mrs_share"] <= 1 + 1e-12
    assert got["outlier_ratio"] >= 1 - 1e-12
    if "kurtosis" in got:
        assert 1 - 1e-9 <= got["kurtosis"] <= channels + 1e-9
    # every figure but absmax and the overflow is scale-free
    scaled = figures(x * scale)
    for name in ("rms_share", "mrs_share", "outlier_ratio", "kurtosis"):
        if name in got and got[name] < RATIO_CAP:
            assert scaled[name] == pytest.approx(got[name], rel=1e-7), name
    assert scaled["absmax"] == pytest.approx(got["absmax"] * scale, rel=1e-12)
