"""The half-precision baselines (``lightning_mrs.swap.half``): each formula computed naively in the input's
dtype (``RMSNormHalf``, ``MRSNormHalf``: the squares formed) and safely (``RMSNormHalfSafe``: scaled by
max|x| first; ``MRSNormHalfSafe``: hypot). Each against the float64 formula below its breaking point,
and where it breaks in float16: both naive arms at exactly |x| = 256 (the square passes 65504), the
safe arms nowhere up to 2^15 and at float16's maximum (MRSNorm's only where a magnitude passes 65504);
and the swap targets ``"rms-half"``, ``"mrs-half"``, ``"rms-half-safe"``, ``"mrs-half-safe"``."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers.reference import mrs_norm_ref, rms_norm_ref
from lightning_mrs import MRSNorm, SwapOptions, swap_norms
from lightning_mrs.swap.half import MRSNormHalf, MRSNormHalfSafe, RMSNormHalf, RMSNormHalfSafe
from lightning_mrs.swap.registry import norm_spec
from lightning_mrs.swap.spec import describe_layers, rebuild

# computed in the input's dtype: the tolerance is that dtype's rounding over a few operations
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3),
       torch.bfloat16: (2e-2, 3e-2)}
SHAPES = [(5, 2), (3, 7, 6), (2, 3, 5, 32), (1, 66)]
NAIVE, SAFE = (RMSNormHalf, MRSNormHalf), (RMSNormHalfSafe, MRSNormHalfSafe)
ARMS = {"rms-half": RMSNormHalf, "mrs-half": MRSNormHalf, "rms-half-safe": RMSNormHalfSafe,
        "mrs-half-safe": MRSNormHalfSafe}


def _weighted(cls: type, c: int, dtype: torch.dtype) -> nn.Module:
    norm = cls(c, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(-2, 2)
    return norm


def _ref(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The float64 formula of ``norm``'s kind with its weights."""
    if isinstance(norm, RMSNormHalf):
        return rms_norm_ref(x, norm.eps) * norm.weight.double()
    return mrs_norm_ref(x, norm.weight, norm.eps)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("cls", list(ARMS.values()))
def test_each_matches_the_float64_formula_where_nothing_overflows(cls: type, shape: tuple[int, ...],
                                                                  dtype: torch.dtype) -> None:
    x = (4 * torch.randn(shape, dtype=torch.float64)).to(dtype)  # |x| well below 256
    atol, rtol = TOL[dtype]
    norm = _weighted(cls, shape[-1], dtype)
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), _ref(norm, x), atol=atol, rtol=rtol)


def test_in_float32_they_compute_what_the_shipped_norms_compute() -> None:
    x = torch.randn(4, 9, 32)
    rms, mrs = nn.RMSNorm(32, eps=1e-6), MRSNorm(32)
    with torch.no_grad():
        rms.weight.uniform_(-2, 2)
        mrs.weight.uniform_(-2, 2)
    for cls, shipped in ((RMSNormHalf, rms), (RMSNormHalfSafe, rms), (MRSNormHalf, mrs), (MRSNormHalfSafe, mrs)):
        half = cls(32)
        half.load_state_dict(shipped.state_dict())  # the same parameters, under the same names
        torch.testing.assert_close(half(x), shipped(x), atol=1e-6, rtol=1e-5)


def test_a_float16_row_of_300s() -> None:
    """Every square of 300 overflows float16 (65504): both naive arms crush the token, both safe ones do not."""
    x = torch.full((2, 32), 300.0, dtype=torch.float16)
    for cls in NAIVE:
        assert torch.equal(cls(32)(x), torch.zeros_like(x))  # rsqrt(Inf) = 0, x / Inf = 0: the token is crushed
    assert torch.isfinite(nn.RMSNorm(32, eps=1e-6, dtype=torch.float16)(x)).all()  # torch's RMSNorm upcasts: 1.0
    torch.testing.assert_close(RMSNormHalfSafe(32)(x).double(), rms_norm_ref(x), atol=1e-3, rtol=1e-3)  # 1.0
    torch.testing.assert_close(MRSNormHalfSafe(32)(x).double(), mrs_norm_ref(x), atol=1e-3, rtol=1e-3)  # 0.707


# below 256 every arm follows float64; 255^2 = 65025 is finite, 256^2 = 65536 rounds past 65504 to Inf
FINE, BROKEN = (16.0, 128.0, 181.0, 200.0, 255.0), (256.0, 300.0, 1024.0, 2.0**15, 65504.0)


def _planted(m: float) -> tuple[torch.Tensor, torch.Tensor]:
    """16 tokens of 32 N(0, 1) channels with channel 5 (the first of phasor 2) set to ``m``: float64, float16."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(int(m)), dtype=torch.float64)
    x[:, 5] = m
    return x, x.half()


@pytest.mark.parametrize("m", FINE + BROKEN)
@pytest.mark.parametrize("cls", NAIVE)
def test_the_naive_arms_break_at_exactly_256(cls: type, m: float) -> None:
    """One planted channel in float16: fine (the float64 formula) up to 255, every token all zeros from 256 on."""
    _, x16 = _planted(m)
    norm = cls(32)
    y = norm(x16)
    if m >= 256:
        assert torch.equal(y, torch.zeros_like(y))
    else:
        assert torch.isfinite(y).all() and (y != 0).any(-1).all()
        torch.testing.assert_close(y.double(), _ref(norm, x16), atol=2e-3, rtol=4e-3)


@pytest.mark.parametrize("m", FINE + BROKEN)
@pytest.mark.parametrize("cls", SAFE)
def test_the_safe_arms_follow_float64_up_to_the_float16_maximum(cls: type, m: float) -> None:
    _, x16 = _planted(m)
    norm = cls(32)
    y = norm(x16)
    assert torch.isfinite(y).all() and (y != 0).any(-1).all()
    torch.testing.assert_close(y.double(), _ref(norm, x16), atol=2e-3, rtol=4e-3)


def test_mrs_half_safe_breaks_only_where_a_magnitude_passes_the_float16_maximum() -> None:
    fine = torch.tensor([[40000.0, 30000.0, 1.0, 1.0]], dtype=torch.float16)  # |z| = 50000 < 65504
    torch.testing.assert_close(MRSNormHalfSafe(4)(fine).double(), mrs_norm_ref(fine), atol=2e-3, rtol=4e-3)
    broken = torch.tensor([[50000.0, 50000.0, 1.0, 1.0]], dtype=torch.float16)  # |z| = 70711: Inf, so is S
    assert torch.equal(MRSNormHalfSafe(4)(broken), torch.zeros_like(broken))  # x / Inf: the token is crushed to zeros
    # RMSNorm's scale never exceeds max|x|: the safe RMSNorm is finite even here
    torch.testing.assert_close(RMSNormHalfSafe(4)(broken).double(), rms_norm_ref(broken), atol=2e-3, rtol=4e-3)


def test_the_safe_arms_keep_zeros_and_tiny_tokens() -> None:
    """A zero token is scaled by sqrt(eps) (no 0/0); a token far below sqrt(eps) follows the formula, eps included."""
    x = torch.zeros(2, 8, dtype=torch.float16)
    x[1] = 1e-4
    for cls in SAFE:
        norm = cls(8)
        torch.testing.assert_close(norm(x).double(), _ref(norm, x), atol=2e-3, rtol=4e-3)


@pytest.mark.parametrize("cls", list(ARMS.values()))
def test_gradcheck_float64_zeros_included(cls: type) -> None:
    norm = _weighted(cls, 6, torch.float64)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    x[0, 0] = 0.0  # a token of zeros: eps keeps it finite
    x[1, 1, :2] = 0.0  # a zero pair: no 0/0 in hypot's gradient
    x[2, 2, 3] = 50.0  # the safe RMSNorm's max|x| at one channel: its (detached) scale leaves the gradient exact
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t, w: torch.func.functional_call(norm, {"weight": w}, (t,)),
                                    (x, norm.weight.detach().clone().requires_grad_(True)))
    norm(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("cls", list(ARMS.values()))
def test_non_contiguous_input(cls: type) -> None:
    x = torch.randn(6, 5, 8).transpose(0, 1)  # (5, 6, 8), not contiguous
    norm = _weighted(cls, 8, torch.float32)
    torch.testing.assert_close(norm(x), norm(x.contiguous()))


@pytest.mark.parametrize("cls", list(ARMS.values()))
def test_fx_symbolic_trace_computes_the_same_and_keeps_the_check(cls: type) -> None:
    norm = _weighted(cls, 8, torch.float32)
    traced = torch.fx.symbolic_trace(norm)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(traced(x), norm(x))
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}(8): expected the last dim to hold 8 channels")):
        traced(torch.randn(3, 4))


# The lower end: with x in [0.5, 1.5) and scale >= 0.1 every square is >= 2.5e-3, a normal float16 (from
# 2^-14 = 6.1e-5), and eps = 1e-6 moves the scale by < 2e-4. Down to scale 1e-2 (the range this test had)
# the naive squares go subnormal in float16 (3 significant bits or fewer) and eps moves the scale by ~1 %,
# so the naive RMSNorm missed the 5e-3 tolerance in about one run in many. The upper end: below 256 for the
# naive arms (1.5 * 100 = 150); the safe arms up to 1e4 (1.5 * sqrt(2) * 1e4 < 65504).
@settings(max_examples=40, deadline=None)
@given(scale=st.floats(0.1, 1e4), c=st.sampled_from([2, 4, 10]), tokens=st.integers(1, 5))
def test_float16_scale_invariance_within_range(scale: float, c: int, tokens: int) -> None:
    """Each is invariant to a positive scale of its input (up to eps and float16 rounding) below its breaking point."""
    x = torch.rand(tokens, c, dtype=torch.float64) + 0.5
    for cls in ARMS.values():
        if cls in NAIVE and scale > 100:
            continue
        norm = cls(c, dtype=torch.float16)
        torch.testing.assert_close(norm((scale * x).half()).double(), norm(x.half()).double(), atol=5e-3, rtol=5e-3)


def test_drop_in_signature_and_errors() -> None:
    norm = MRSNormHalf(8, eps=1e-5, affine=True, dtype=torch.float16)
    assert norm.weight.shape == (4,) and norm.weight.dtype == torch.float16 and norm.num_phasors == 4
    assert repr(norm) == "MRSNormHalf(8, eps=1e-05, affine=True)"
    assert RMSNormHalf(8, affine=False).weight is None
    assert repr(RMSNormHalf(8)) == "RMSNormHalf(8, eps=1e-06, affine=True)"
    with torch.no_grad():
        norm.weight.fill_(3.0)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=re.escape("MRSNormHalf(7): MRSNorm pairs adjacent channels")):
        MRSNormHalf(7)
    with pytest.raises(ValueError, match="eps must be > 0"):
        RMSNormHalf(8, eps=0.0)
    with pytest.raises(ValueError, match=re.escape("RMSNormHalf(8): expected the last dim to hold 8 channels")):
        RMSNormHalf(8)(torch.randn(2, 8, 3))
    assert {kind: norm_spec(cls(8)).kind for kind, cls in ARMS.items()} == {kind: kind for kind in ARMS}
    assert repr(MRSNormHalfSafe(8)) == "MRSNormHalfSafe(8, eps=1e-06, affine=True)"
    assert repr(RMSNormHalfSafe(8)) == "RMSNormHalfSafe(8, eps=1e-06, affine=True)"
    with pytest.raises(ValueError, match=re.escape("MRSNormHalfSafe(7): MRSNorm pairs adjacent channels")):
        MRSNormHalfSafe(7)
    with pytest.raises(ValueError, match="RMSNormHalfSafe: eps must be > 0"):
        RMSNormHalfSafe(8, eps=0.0)


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.RMSNorm(8, eps=1e-6), nn.Linear(8, 8), MRSNorm(8), nn.Conv1d(8, 8, 1),
                         nn.BatchNorm1d(8))


@pytest.mark.parametrize("target,cls", list(ARMS.items()))
def test_swap_targets_convert_channels_last_norms_and_refuse_the_others(target: str, cls: type) -> None:
    model = _model()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2)
        model[3].weight.uniform_(0.5, 2)
    x = torch.randn(3, 4)
    w_rms, w_mrs = model[1].weight.detach().clone(), model[3].weight.detach().clone()  # (8,), (4,)
    report = swap_norms(model, target)
    assert report.converted == ["1", "3"] and isinstance(model[1], cls) and isinstance(model[3], cls)
    assert report.skipped == {"5": f"target={target!r} is an experimental channels-last baseline; this norm is "
                                    "channels-first (keep it, exclude it, or use target='rms'/'mrs')"}
    assert isinstance(model[5], nn.BatchNorm1d)
    # weights inherited: an MRS weight per phasor <-> the mean of its two channels' weights
    if issubclass(cls, RMSNormHalf):
        assert torch.equal(model[1].weight, w_rms) and torch.equal(model[3].weight, w_mrs.repeat_interleave(2))
    else:
        assert torch.equal(model[1].weight, w_rms.reshape(4, 2).mean(1)) and torch.equal(model[3].weight, w_mrs)
    assert swap_norms(model, target).unchanged == ["1", "3"]  # a second swap is a no-op
    records = describe_layers(model, target)
    assert records == {n: {"kind": target, "channel_dim": -1, "spatial": None, "eps": 1e-6} for n in ("1", "3")}
    fresh = _model()
    rebuild(fresh, target, records)
    assert describe_layers(fresh, target) == records
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh[:4](x), model[:4](x))


@pytest.mark.parametrize("suffix", ["", "-safe"])
def test_swapped_model_computes_the_original_in_float32(suffix: str) -> None:
    model = _model()[:4]
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2)
    x = torch.randn(5, 4)
    before = model(x)
    swap_norms(model, f"rms-half{suffix}", include=["1"])
    swap_norms(model, f"mrs-half{suffix}", include=["3"])
    torch.testing.assert_close(model(x), before, atol=1e-6, rtol=1e-5)


def test_qk_norm_true_needs_a_qk_kind_and_odd_widths_are_skipped() -> None:
    with pytest.raises(ValueError, match=re.escape("but target='mrs-half'; name the kind instead")):
        SwapOptions("mrs-half", qk_norm=True)
    model = nn.Sequential(nn.Linear(4, 7), nn.LayerNorm(7))
    report = swap_norms(model, "rms-half", strict=False)
    assert report.converted == ["1"]
    with pytest.warns(UserWarning, match="converted none"):
        report = swap_norms(nn.Sequential(nn.Linear(4, 7), nn.LayerNorm(7)), "mrs-half")
    assert report.skipped == {"1": "odd channel count 7: MRSNorm pairs adjacent channels; keep or exclude this norm"}
    with pytest.warns(UserWarning, match="converted none"):
        report = swap_norms(nn.Sequential(nn.Linear(4, 7), nn.LayerNorm(7)), "mrs-half-safe")
    assert report.skipped == {"1": "odd channel count 7: MRSNorm pairs adjacent channels; keep or exclude this norm"}


def test_the_naive_rms_backward_overflows_at_a_small_rms() -> None:
    """autograd's rsqrt backward forms rsqrt(mean(x^2))^3 in float16, past 65504 where the token's RMS is below
    65504^(-1/3) = 0.0248 (earlier with a large incoming gradient): the naive RMSNorm's gradient is non-finite
    there (a Llama's residual stream starts at about 0.02); the safe arms' is not."""
    for scale, finite in ((1.0, True), (0.1, True), (0.02, False)):
        x = torch.full((2, 32), scale, dtype=torch.float16, requires_grad=True)
        RMSNormHalf(32)(x).float().pow(2).sum().backward()
        assert bool(torch.isfinite(x.grad).all()) == finite, scale
    for cls in SAFE:
        x = torch.full((2, 32), 0.02, dtype=torch.float16, requires_grad=True)
        cls(32)(x).float().pow(2).sum().backward()
        assert torch.isfinite(x.grad).all()
