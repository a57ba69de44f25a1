"""The op and its modules under ``torch.func`` transforms: ``grad`` of ``functional_call`` equal to
the eager gradient, forward-mode AD keeping its tangents, ``vmap`` equal to a loop (over the batch, over a weight ensemble, with the
channels and the batch dim anywhere), ``jacrev``/``jacfwd``/``vjp`` against autograd, and
float64 ``gradcheck`` through the transforms. Under a transform the op runs the reference
formula (``lightning_mrs.ops.mrs_norm``), so the eager kernels' results are the reference here.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.autograd import gradcheck
from torch.func import functional_call, grad, jacfwd, jacrev, vjp, vmap

from lightning_mrs import MRSNorm, MRSNorm2d, mrs_norm
from helpers.checks import TOLS, make_inputs


def _loss(module: torch.nn.Module, params: dict[str, Tensor], x: Tensor, gy: Tensor) -> Tensor:
    return (functional_call(module, params, (x,)) * gy).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["f32", "bf16", "f64"])
@pytest.mark.parametrize("make", [lambda: MRSNorm(16), lambda: MRSNorm2d(16), lambda: MRSNorm2d(16, spatial=True)],
                         ids=["MRSNorm", "MRSNorm2d", "MRSNorm2d_spatial"])
def test_grad_of_functional_call_equals_the_eager_gradient(make, dtype: torch.dtype) -> None:
    module = make().to(dtype)
    shape = (3, 5, 16) if isinstance(module, MRSNorm) else (3, 16, 4, 5)
    channel_dim = -1 if isinstance(module, MRSNorm) else 1
    x, w, gy = make_inputs(shape, channel_dim, None, dtype)
    with torch.no_grad():
        module.weight.copy_(w)
    params = {"weight": module.weight.detach()}
    got_w, got_x = grad(lambda p, a: _loss(module, p, a, gy), argnums=(0, 1))(params, x)
    xe = x.clone().requires_grad_()
    (module(xe) * gy).sum().backward()  # the eager op: the fused kernels and their Function
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got_x, xe.grad, atol=10 * atol, rtol=10 * rtol)
    scale = max(module.weight.grad.abs().max().item(), 1.0)
    torch.testing.assert_close(got_w["weight"], module.weight.grad, atol=10 * atol * scale, rtol=10 * rtol)


PER_INPUT = (4, 6, 8)  # one input of the batch; every dim even, so any can hold the channels
VMAP_CASES = [(0, -1, False), (1, -1, False), (3, 0, False), (2, 1, False), (0, 1, True), (3, 1, True), (1, -1, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("in_dims,channel_dim,spatial", VMAP_CASES,
                         ids=[f"batch{b}-channels{c}-{'per_sample' if s else 'per_position'}" for b, c, s in VMAP_CASES])
def test_vmap_equals_a_loop(in_dims: int, channel_dim: int, spatial: bool, dtype: torch.dtype) -> None:
    per = torch.randn(5, *PER_INPUT, dtype=dtype)  # five inputs
    w = torch.rand(PER_INPUT[channel_dim] // 2, dtype=dtype) + 0.5

    def fn(a: Tensor) -> Tensor:
        return mrs_norm(a, w, channel_dim=channel_dim, spatial=spatial)

    got = vmap(fn, in_dims=in_dims)(per.movedim(0, in_dims))
    loop = torch.stack([fn(a) for a in per])  # the eager op: its fused kernels
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got, loop, atol=atol, rtol=rtol)


def test_vmap_over_a_weight_ensemble_equals_a_loop() -> None:
    x = torch.randn(3, 7, 16)
    ws = torch.rand(4, 8) + 0.5  # four weights of 8 phasors
    got = vmap(lambda w: mrs_norm(x, w))(ws)
    torch.testing.assert_close(got, torch.stack([mrs_norm(x, w) for w in ws]), atol=2e-6, rtol=2e-6)


def test_per_sample_gradients_with_vmap_of_grad_equal_a_loop() -> None:
    module = MRSNorm(16)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    xs, gys = torch.randn(6, 5, 16), torch.randn(6, 5, 16)
    params = {"weight": module.weight.detach()}
    got = vmap(grad(lambda p, a, g: _loss(module, p, a, g)), in_dims=(None, 0, 0))(params, xs, gys)["weight"]
    loop = []
    for a, g in zip(xs, gys):
        module.zero_grad()
        (module(a) * g).sum().backward()  # eager: the fused kernels
        loop.append(module.weight.grad.clone())
    torch.testing.assert_close(got, torch.stack(loop), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("jac", [jacrev, jacfwd], ids=["jacrev", "jacfwd"])
def test_jacobians_equal_autograds(jac) -> None:
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    w = torch.rand(4, dtype=torch.float64) + 0.5
    fn = lambda a: mrs_norm(a, w)  # noqa: E731
    got = jac(fn)(x)
    ref = torch.autograd.functional.jacobian(fn, x)  # eager: the fused Function's backward
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)


def test_vjp_equals_backward() -> None:
    x, w, gy = make_inputs((4, 6, 10), 1, None, torch.float64)
    y, pull = vjp(lambda a, b: mrs_norm(a, b, channel_dim=1, spatial=True), x, w)
    dx, dw = pull(gy)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    ye = mrs_norm(xe, we, channel_dim=1, spatial=True)
    ye.backward(gy)
    torch.testing.assert_close(y, ye.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(dx, xe.grad, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(dw, we.grad, atol=1e-12, rtol=1e-10)


def test_forward_mode_ad_keeps_the_tangents() -> None:
    # the fused kernels have no jvp: inside a dual level the op must not drop the tangent
    import torch.autograd.forward_ad as fwAD

    x, w, _ = make_inputs((3, 5, 8), -1, None, torch.float64)
    t = torch.randn_like(x)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(mrs_norm(fwAD.make_dual(x, t), w)).tangent
    _, expected = torch.func.jvp(lambda a: mrs_norm(a, w), (x,), (t,))
    assert tangent is not None
    torch.testing.assert_close(tangent, expected, atol=1e-12, rtol=1e-10)


def test_gradcheck_float64_through_vmap_and_grad() -> None:
    x, w, gy = make_inputs((3, 2, 6), -1, None, torch.float64)
    x.requires_grad_()
    w.requires_grad_()
    batched = lambda a, b: vmap(lambda row: mrs_norm(row, b))(a)  # noqa: E731
    assert gradcheck(batched, (x, w), eps=1e-6, atol=1e-7)
    input_grad = lambda a, b: grad(lambda t: (mrs_norm(t, b) * gy).sum())(a)  # noqa: E731 - second order
    assert gradcheck(input_grad, (x, w), eps=1e-6, atol=1e-6)
