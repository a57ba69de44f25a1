"""``RMSNormHalf`` / ``MRSNormHalf`` (``lightning_mrs.swap.half``): the float64 formulas where nothing
overflows, the float16 overflow the paper describes (a channel past 256 zeroes RMSNorm computed in
float16, MRSNorm computed in float16 stays finite up to float16's maximum), and the swap targets
``"rms-half"`` / ``"mrs-half"``."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from helpers.reference import mrs_norm_ref, rms_norm_ref
from lightning_mrs import MRSNorm, SwapOptions, swap_norms
from lightning_mrs.swap.half import MRSNormHalf, RMSNormHalf
from lightning_mrs.swap.registry import norm_spec
from lightning_mrs.swap.spec import describe_layers, rebuild

# computed in the input's dtype: the tolerance is that dtype's rounding over a few operations
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3),
       torch.bfloat16: (2e-2, 3e-2)}
SHAPES = [(5, 2), (3, 7, 6), (2, 3, 5, 32), (1, 66)]


def _weighted(cls: type, c: int, dtype: torch.dtype) -> nn.Module:
    norm = cls(c, dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(-2, 2)
    return norm


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOL))
def test_both_match_the_float64_formulas_where_nothing_overflows(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (4 * torch.randn(shape, dtype=torch.float64)).to(dtype)  # |x| well below 256
    atol, rtol = TOL[dtype]
    rms, mrs = _weighted(RMSNormHalf, shape[-1], dtype), _weighted(MRSNormHalf, shape[-1], dtype)
    for norm, ref in ((rms, rms_norm_ref(x) * rms.weight.double()), (mrs, mrs_norm_ref(x, mrs.weight))):
        y = norm(x)
        assert y.dtype == dtype and y.shape == x.shape
        torch.testing.assert_close(y.double(), ref, atol=atol, rtol=rtol)


def test_in_float32_they_compute_what_the_shipped_norms_compute() -> None:
    x = torch.randn(4, 9, 32)
    rms, mrs = nn.RMSNorm(32, eps=1e-6), MRSNorm(32)
    with torch.no_grad():
        rms.weight.uniform_(-2, 2)
        mrs.weight.uniform_(-2, 2)
    rms_half, mrs_half = RMSNormHalf(32), MRSNormHalf(32)
    rms_half.load_state_dict(rms.state_dict())  # the same parameters, under the same names
    mrs_half.load_state_dict(mrs.state_dict())
    torch.testing.assert_close(rms_half(x), rms(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mrs_half(x), mrs(x), atol=1e-6, rtol=1e-5)


def test_a_float16_row_of_300s() -> None:
    """The issue's measurement: every square of 300 overflows float16 (65504)."""
    x = torch.full((2, 32), 300.0, dtype=torch.float16)
    assert torch.equal(RMSNormHalf(32)(x), torch.zeros_like(x))  # rsqrt(Inf) = 0: the token is crushed to zeros
    assert torch.isfinite(nn.RMSNorm(32, eps=1e-6, dtype=torch.float16)(x)).all()  # torch's RMSNorm upcasts: 1.0
    y = MRSNormHalf(32)(x)
    torch.testing.assert_close(y.double(), mrs_norm_ref(x), atol=1e-3, rtol=1e-3)  # 1/sqrt(2) = 0.707


@pytest.mark.parametrize("k", range(4, 16))
def test_one_planted_channel_breaks_rms_half_from_256_and_mrs_half_never(k: int) -> None:
    """A channel at 2^k among N(0, 1) ones, in float16: RMSNormHalf gives all-zero tokens exactly where
    (2^k)^2 passes 65504 (k >= 8), MRSNormHalf follows the float64 formula at every k up to 2^15."""
    x = torch.randn(16, 32, dtype=torch.float64)
    x[:, 5] = 2.0**k
    x16 = x.half()
    rms = RMSNormHalf(32)(x16)
    if k >= 8:
        assert torch.equal(rms, torch.zeros_like(rms))
    else:
        assert (rms != 0).any(-1).all()
        torch.testing.assert_close(rms.double(), rms_norm_ref(x16), atol=2e-3, rtol=4e-3)
    mrs = MRSNormHalf(32)(x16)
    assert torch.isfinite(mrs).all() and (mrs != 0).any(-1).all()
    torch.testing.assert_close(mrs.double(), mrs_norm_ref(x16), atol=2e-3, rtol=4e-3)


def test_mrs_half_breaks_only_where_a_magnitude_passes_the_float16_maximum() -> None:
    fine = torch.tensor([[40000.0, 30000.0, 1.0, 1.0]], dtype=torch.float16)  # |z| = 50000 < 65504
    assert torch.isfinite(MRSNormHalf(4)(fine)).all()
    broken = torch.tensor([[50000.0, 50000.0, 1.0, 1.0]], dtype=torch.float16)  # |z| = 70711: Inf, so is S
    assert torch.equal(MRSNormHalf(4)(broken), torch.zeros_like(broken))  # x / Inf: the token is crushed to zeros


@pytest.mark.parametrize("cls", [RMSNormHalf, MRSNormHalf])
def test_gradcheck_float64_zeros_included(cls: type) -> None:
    norm = _weighted(cls, 6, torch.float64)
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    x[0, 0] = 0.0  # a token of zeros: eps keeps it finite
    x[1, 1, :2] = 0.0  # a zero pair: no 0/0 in hypot's gradient
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t, w: torch.func.functional_call(norm, {"weight": w}, (t,)),
                                    (x, norm.weight.detach().clone().requires_grad_(True)))
    norm(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("cls", [RMSNormHalf, MRSNormHalf])
def test_non_contiguous_input(cls: type) -> None:
    x = torch.randn(6, 5, 8).transpose(0, 1)  # (5, 6, 8), not contiguous
    norm = _weighted(cls, 8, torch.float32)
    torch.testing.assert_close(norm(x), norm(x.contiguous()))


@settings(max_examples=40, deadline=None)
@given(scale=st.floats(1e-2, 1e2), c=st.sampled_from([2, 4, 10]), tokens=st.integers(1, 5))
def test_float16_scale_invariance_within_range(scale: float, c: int, tokens: int) -> None:
    """Both are invariant to a positive scale of their input (up to eps and float16 rounding)."""
    x = torch.rand(tokens, c, dtype=torch.float64) + 0.5
    for cls in (RMSNormHalf, MRSNormHalf):
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
    assert norm_spec(RMSNormHalf(8)).kind == "rms-half" and norm_spec(norm).kind == "mrs-half"


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.RMSNorm(8, eps=1e-6), nn.Linear(8, 8), MRSNorm(8), nn.Conv1d(8, 8, 1),
                         nn.BatchNorm1d(8))


@pytest.mark.parametrize("target,cls", [("rms-half", RMSNormHalf), ("mrs-half", MRSNormHalf)])
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
    if cls is RMSNormHalf:
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


def test_swapped_model_computes_the_original_in_float32() -> None:
    model = _model()[:4]
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 2)
    x = torch.randn(5, 4)
    before = model(x)
    swap_norms(model, "rms-half", include=["1"])
    swap_norms(model, "mrs-half", include=["3"])
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
