"""Gradients of ``mrs_norm``: gradcheck in float64 and autograd of the independent reference."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from lightning_mrs import mrs_norm
from helpers.reference import mrs_norm_ref

LAYOUTS = [  # (shape, channel_dim, spatial)
    ((3, 6), -1, False),
    ((2, 3, 4), -1, False),
    ((2, 4, 3), 1, False),
    ((2, 6, 2, 3), 1, False),
    ((2, 4, 3), 1, True),
    ((2, 6, 2, 3), 1, True),
    ((1, 2, 1, 2, 2), 1, True),
]


@pytest.mark.parametrize("shape,channel_dim,spatial", LAYOUTS)
@pytest.mark.parametrize("affine", [False, True])
def test_gradcheck_float64(shape, channel_dim, spatial, affine):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    p = shape[channel_dim] // 2
    inputs = (x, torch.randn(p, dtype=torch.float64, requires_grad=True)) if affine else (x,)

    def fn(*args):
        return mrs_norm(*args, channel_dim=channel_dim, spatial=spatial)

    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape,channel_dim,spatial", LAYOUTS)
def test_gradients_match_reference_autograd(shape, channel_dim, spatial):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64) * 2
    w = torch.randn(shape[channel_dim] // 2, dtype=torch.float64)
    g = torch.randn(shape, dtype=torch.float64)  # upstream gradient

    def grads(fn):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xi, wi, 1e-6, channel_dim=channel_dim, spatial=spatial).backward(g)
        return xi.grad, wi.grad

    dx, dw = grads(mrs_norm)
    dx_ref, dw_ref = grads(mrs_norm_ref)
    torch.testing.assert_close(dx, dx_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(dw, dw_ref, atol=1e-10, rtol=1e-10)


def test_backward_matches_the_closed_form_of_paper():
    """PAPER.md's fused backward: dx_k = (w g_k - c/(P S) * x_k / r_p(k)) / S."""
    torch.manual_seed(2)
    rows, c_, eps = 5, 8, 1e-6
    p = c_ // 2
    x = torch.randn(rows, c_, dtype=torch.float64, requires_grad=True)
    w = torch.randn(p, dtype=torch.float64, requires_grad=True)
    g = torch.randn(rows, c_, dtype=torch.float64)
    mrs_norm(x, w, eps).backward(g)

    xd = x.detach()
    r = torch.sqrt(xd[:, 0::2] ** 2 + xd[:, 1::2] ** 2 + eps).repeat_interleave(2, dim=1)  # (rows, C)
    s = torch.sqrt(xd[:, 0::2] ** 2 + xd[:, 1::2] ** 2 + eps).mean(1, keepdim=True)  # (rows, 1)
    wk = w.detach().repeat_interleave(2)  # (C,)
    c = (wk * g * xd).sum(1, keepdim=True)  # (rows, 1)
    dx = (wk * g - c / (p * s) * xd / r) / s
    dw = ((g * xd) / s).reshape(rows, p, 2).sum(dim=(0, 2))
    torch.testing.assert_close(x.grad, dx, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w.grad, dw, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_half_gradients_are_close_to_float64(dtype):
    torch.manual_seed(3)
    x = torch.randn(16, 32)
    g = torch.randn(16, 32)
    xi = x.to(dtype).detach().requires_grad_()
    mrs_norm(xi).backward(g.to(dtype))
    assert xi.grad.dtype == dtype
    x64 = x.to(dtype).double().detach().requires_grad_()
    mrs_norm_ref(x64).backward(g.to(dtype).double())
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(xi.grad.double(), x64.grad, atol=tol, rtol=tol)


def test_double_backward_float64():
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert gradgradcheck(lambda a, b: mrs_norm(a, b), (x, w), atol=1e-6)
