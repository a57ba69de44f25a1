"""``MRSNorm`` / ``MRSNorm2d``: drop-in modules over the functional op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mrs import MRSNorm, MRSNorm2d
from helpers.reference import mrs_norm_ref


@pytest.mark.parametrize("shape", [(5, 8), (2, 7, 64), (3, 4, 5, 6)])
def test_mrsnorm_matches_reference_float64(shape):
    torch.manual_seed(0)
    norm = MRSNorm(shape[-1], dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(-2, 2)
    x = torch.randn(shape, dtype=torch.float64)
    y = norm(x)
    ref = mrs_norm_ref(x, norm.weight.detach())
    assert (y - ref).abs().max() < 1e-9


@pytest.mark.parametrize("shape", [(2, 6), (2, 6, 11), (3, 8, 5, 7), (2, 4, 3, 5, 2)])
@pytest.mark.parametrize("spatial", [False, True])
def test_mrsnorm2d_matches_reference_float64(shape, spatial):
    torch.manual_seed(1)
    norm = MRSNorm2d(shape[1], spatial=spatial, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(-2, 2)
    x = torch.randn(shape, dtype=torch.float64)
    ref = mrs_norm_ref(x, norm.weight.detach(), channel_dim=1, spatial=spatial)
    assert (norm(x) - ref).abs().max() < 1e-9


def test_mrsnorm2d_equals_mrsnorm_on_permuted_input():
    torch.manual_seed(2)
    x = torch.randn(2, 8, 3, 5)
    a, b = MRSNorm2d(8), MRSNorm(8)
    with torch.no_grad():
        a.weight.normal_()
        b.weight.copy_(a.weight)
    torch.testing.assert_close(a(x), b(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


def test_drop_in_for_layernorm_in_a_transformer_block():
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    layer.norm1, layer.norm2 = MRSNorm(32), MRSNorm(32)
    x = torch.randn(2, 9, 32)
    layer(x).sum().backward()
    assert layer.norm1.weight.grad is not None and torch.isfinite(layer.norm1.weight.grad).all()


@pytest.mark.parametrize("cls", [MRSNorm, MRSNorm2d])
def test_signature_parameters_and_state_dict(cls):
    norm = cls(16, eps=1e-5, affine=True, device="cpu", dtype=torch.float64)
    assert norm.weight.shape == (8,) and norm.weight.dtype == torch.float64
    assert list(norm.state_dict()) == ["weight"]
    assert norm.num_channels == 16 and norm.num_phasors == 8 and norm.eps == 1e-5
    with torch.no_grad():
        norm.weight.fill_(3.0)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8, dtype=torch.float64))
    assert "16, eps=1e-05, affine=True" in repr(norm)
    plain = cls(16, affine=False)
    assert plain.weight is None and list(plain.state_dict()) == []


def test_meta_device_construction():
    norm = MRSNorm2d(64, device="meta")
    assert norm.weight.is_meta


def test_mrsnorm2d_repr_shows_spatial():
    assert "spatial=True" in repr(MRSNorm2d(4, spatial=True))


@pytest.mark.parametrize("cls", [MRSNorm, MRSNorm2d])
@pytest.mark.parametrize("c", [1, 3, 127])
def test_odd_channel_count_explains_the_pairing(cls, c):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\({c}\).*pairs.*even"):
        cls(c)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_invalid_channel_count(bad):
    with pytest.raises(ValueError, match="num_channels"):
        MRSNorm(bad)


def test_channel_mismatch_names_both_sizes():
    with pytest.raises(ValueError, match=r"64.*\(2, 3, 32\)"):
        MRSNorm(64)(torch.randn(2, 3, 32))
    with pytest.raises(ValueError, match=r"\(N, 64, \*spatial\).*\(2, 32, 4, 4\)"):
        MRSNorm2d(64)(torch.randn(2, 32, 4, 4))


def test_non_floating_input_is_rejected():
    with pytest.raises(ValueError, match="floating-point"):
        MRSNorm(4)(torch.ones(2, 4, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_module_returns_half(dtype):
    norm = MRSNorm2d(8, spatial=True, dtype=dtype)
    x = torch.randn(2, 8, 4, 4, dtype=dtype)
    y = norm(x)
    assert y.dtype == dtype
    ref = mrs_norm_ref(x, norm.weight, channel_dim=1, spatial=True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


def test_fp32_weights_with_autocast_style_half_input():
    norm = MRSNorm(8)  # fp32 parameters, half activations as under autocast
    x = torch.randn(3, 8).half()
    y = norm(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.double(), mrs_norm_ref(x, norm.weight), atol=2e-3, rtol=2e-3)


def test_channels_last_module():
    torch.manual_seed(3)
    conv = nn.Conv2d(3, 8, 3, padding=1).to(memory_format=torch.channels_last)
    norm = MRSNorm2d(8)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    y = norm(conv(x))
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.double(), mrs_norm_ref(conv(x), norm.weight, channel_dim=1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls,shape", [(MRSNorm, (4, 6, 16)), (MRSNorm2d, (2, 16, 5, 5))])
def test_torch_compile_fullgraph_matches_eager(cls, shape):
    torch._dynamo.reset()
    torch.manual_seed(4)
    model = nn.Sequential(cls(16), nn.GELU())
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break raises
    x = torch.randn(shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = compiled(x), model(x2)
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=1e-5)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-5, rtol=1e-5)
    explanation = torch._dynamo.explain(model)(x.detach())
    assert explanation.graph_break_count == 0
