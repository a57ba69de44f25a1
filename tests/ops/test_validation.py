"""Argument checks of ``mrs_norm`` (``lightning_mrs.ops.validation``): every bad call fails
with a message that names the caller and the fix, before any kernel runs (the C++ kernels
take raw pointers: a weight they cannot read would be silently dropped); mixed floating
dtypes, as under autocast, are not bad calls.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mrs import MRSNorm, mrs_norm
from lightning_mrs.ops import dispatch
from helpers.checks import CPP_BUILT, assert_matches_reference, forced, grads, make_inputs
from helpers.reference import mrs_norm_ref

router = importlib.import_module("lightning_mrs.ops.mrs_norm")  # the package's mrs_norm is the function

BACKENDS = ("auto", "eager", "torch", "inductor", "cpp")


def test_integer_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="floating-point tensor, got dtype torch.int64.*x.float()"):
        mrs_norm(torch.ones(2, 4, dtype=torch.int64))


def test_odd_channel_count_is_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"even; got 5 channels.*Pad or project"):
        mrs_norm(torch.randn(2, 5))


def test_channel_dim_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"channel_dim=2 is out of range for a 2-d input"):
        mrs_norm(torch.randn(2, 8), channel_dim=2)


def test_spatial_needs_the_channels_off_the_batch_dim() -> None:
    with pytest.raises(ValueError, match=r"spatial=True.*channel_dim=0"):
        mrs_norm(torch.randn(8, 3), channel_dim=0, spatial=True)


@pytest.mark.parametrize("eps", [0.0, -1.0])
def test_non_positive_eps_is_rejected(eps: float) -> None:
    with pytest.raises(ValueError, match="eps must be > 0"):
        mrs_norm(torch.randn(2, 8), eps=eps)


def test_weight_of_wrong_shape_names_both_sizes() -> None:
    with pytest.raises(ValueError, match=r"shape \(4,\) for 8 channels; got shape \(8,\)"):
        mrs_norm(torch.randn(2, 8), torch.ones(8))


# --- regression: a weight the kernels cannot use was dropped without a word ------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_on_the_meta_device_is_refused(backend: str) -> None:
    # it used to return the result without the weight (a null pointer for the C++ kernels)
    with pytest.raises(RuntimeError, match="weight is on the meta device.*to_empty"):
        forced(backend)(torch.randn(2, 8), torch.full((4,), 3.0, device="meta"))


def test_input_on_the_meta_device_with_a_real_weight_is_refused() -> None:
    with pytest.raises(RuntimeError, match="input is on meta and the weight on cpu"):
        mrs_norm(torch.randn(2, 8, device="meta"), torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_non_floating_weight_is_refused(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=f"weight must be a floating-point tensor, got dtype {dtype}"):
        mrs_norm(torch.randn(2, 8), torch.ones(4, dtype=dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight", ["meta", "int64", "wrong_shape"])
def test_weights_are_checked_before_any_kernel(weight: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args: Any) -> None:
        raise AssertionError("a kernel was reached with a bad weight")

    monkeypatch.setattr(dispatch, "get_backend", no_kernel)  # every Python backend comes through here
    for name in ("FWD", "fallback_fwd", "MRSNormFunction"):  # the router calls the operators directly
        monkeypatch.setattr(router, name, no_kernel)
    bad = {"meta": torch.ones(4, device="meta"), "int64": torch.ones(4, dtype=torch.int64),
           "wrong_shape": torch.ones(3)}[weight]
    with pytest.raises((ValueError, RuntimeError), match="mrs_norm: "):
        forced(backend)(torch.randn(2, 8), bad)


# --- mixed floating dtypes are fine ---------------------------------------------------------
MIXED_BACKENDS = ["auto", "eager", "torch"] + (["cpp"] if CPP_BUILT else [])


@pytest.mark.parametrize("backend", MIXED_BACKENDS)
@pytest.mark.parametrize("layout", [((5, 16), -1, False), ((2, 16, 3, 3), 1, True)], ids=["rows", "nchw_per_sample"])
def test_float32_weight_with_bfloat16_input(backend: str, layout: tuple) -> None:
    # as under autocast: fp32 parameters beside bf16 activations; the output and the input
    # gradient in bf16, the weight gradient in fp32
    shape, channel_dim, spatial = layout
    x, w, gy = make_inputs(shape, channel_dim, None, torch.bfloat16)
    w = w.float()
    got = grads(forced(backend, channel_dim, spatial), x, w, gy)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert_matches_reference(got, x, w, gy, channel_dim, spatial)


def test_module_under_autocast_returns_the_activation_dtype() -> None:
    linear, norm = nn.Linear(8, 16), MRSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = linear(torch.randn(4, 8))  # bf16 under autocast
        y = norm(h)
    assert h.dtype == y.dtype == torch.bfloat16 and norm.weight.dtype == torch.float32
    torch.testing.assert_close(y.double(), mrs_norm_ref(h, norm.weight.detach()), atol=3e-2, rtol=3e-2)
    y.float().sum().backward()
    assert norm.weight.grad.dtype == torch.float32 and torch.isfinite(norm.weight.grad).all()
