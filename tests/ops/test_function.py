"""The one autograd Function (``lightning_mrs.ops.library.MRSNormFunction``), whatever backend runs it: what
it saves for the backward, its output as a plain tensor (in-place ops after it), its
gradients (gradcheck, double backward, the closed form of docs/method.md) and ``torch.compile`` of a
model around it. The backends' numbers against the reference are in ``test_backends.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from lightning_mrs import mrs_norm
from helpers.checks import LAYOUTS as ALL_LAYOUTS, cpu_backends, forced, make_inputs, norm_model, saved_bytes
from helpers.reference import mrs_norm_ref

BACKENDS = cpu_backends()
# three layouts, one per kernel shape; the cpp backend covers all three
LAYOUTS = {name: ALL_LAYOUTS[name] for name in ("tokens", "nchw_per_sample", "nhwc_per_position")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_saves_only_x_and_one_scale_per_group(backend: str, layout: str) -> None:
    shape, channel_dim, spatial, memory_format = LAYOUTS[layout]
    x, w, _ = make_inputs(shape, channel_dim, memory_format, torch.float32)
    x.requires_grad_()
    w.requires_grad_()
    y, nbytes = saved_bytes(lambda t: forced(backend, channel_dim, spatial)(t, w), x)
    groups = shape[0] if spatial else x.numel() // shape[channel_dim]
    assert nbytes <= x.numel() * 4 + w.numel() * 4 + groups * 4  # x, the weight, P * S in fp32
    # the reference formula, for contrast, keeps several tensors of x's size
    _, reference_bytes = saved_bytes(lambda t: mrs_norm(t, w, channel_dim=channel_dim, spatial=spatial,
                                                        backend="eager"), x)
    assert reference_bytes > 2 * x.numel() * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_activation_on_the_output(backend: str) -> None:
    # the output is not a view (no _base): autograd allows relu_ on it, and the backward needs
    # no CopySlices copies of the gradient
    x, w, gy = make_inputs((3, 64, 5, 7), 1, torch.channels_last, torch.float32)
    x.requires_grad_()
    y = forced(backend, 1, False)(x, w)
    assert y._base is None
    torch.relu_(y).backward(gy)
    xr = x.detach().double().requires_grad_()
    ref = torch.relu(mrs_norm_ref(xr, w.double(), channel_dim=1))
    ref.backward(gy.double())
    torch.testing.assert_close(y.detach().double(), ref.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=2e-4, rtol=2e-4)


# tiny float64 layouts for gradcheck: (shape, channel_dim, spatial, memory_format)
TINY = {
    "rows": ((3, 6), -1, False, None),
    "tokens_per_sample": ((2, 3, 4), -1, True, None),
    "nchw_per_position": ((2, 6, 2, 3), 1, False, None),
    "nchw_per_sample": ((2, 6, 2, 3), 1, True, None),
    "nhwc_per_sample": ((2, 4, 3, 2), 1, True, torch.channels_last),
    "middle_dim": ((2, 3, 4, 2), 2, False, None),
    "size_one_dims": ((1, 2, 1, 2, 2), 1, True, None),
}


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("layout", list(TINY))
def test_gradcheck_and_gradgradcheck_float64(layout: str, affine: bool) -> None:
    shape, channel_dim, spatial, memory_format = TINY[layout]
    x, w, _ = make_inputs(shape, channel_dim, memory_format, torch.float64, affine)
    inputs = (x.requires_grad_(),) + ((w.requires_grad_(),) if affine else ())
    fused = forced("torch", channel_dim, spatial)  # float64 runs the torch bodies only
    fn = (lambda a, b: fused(a, b)) if affine else (lambda a: fused(a, None))
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7)
    assert gradgradcheck(fn, inputs, eps=1e-6, atol=1e-6)


def test_backward_is_the_closed_form_of_paper() -> None:
    """The fused backward of docs/method.md#the-fused-forward-and-backward:
    dx_k = (w g_k - c/(P S) x_k / r_p(k)) / S, c = sum w g x, dw_i = sum over rows of
    (g x)[2i:2i+2] / S, written out here in float64."""
    rows, channels, eps = 5, 8, 1e-6
    phasors = channels // 2
    x, w, g = make_inputs((rows, channels), -1, None, torch.float64)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    forced("torch")(xg, wg).backward(g)

    r = torch.sqrt(x[:, 0::2] ** 2 + x[:, 1::2] ** 2 + eps)  # (rows, P)
    s = r.mean(1, keepdim=True)  # (rows, 1)
    r_k, w_k = r.repeat_interleave(2, dim=1), w.repeat_interleave(2)  # (rows, C), (C,)
    c = (w_k * g * x).sum(1, keepdim=True)  # (rows, 1)
    dx = (w_k * g - c / (phasors * s) * x / r_k) / s
    dw = ((g * x) / s).reshape(rows, phasors, 2).sum(dim=(0, 2))
    torch.testing.assert_close(xg.grad, dx, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(wg.grad, dw, atol=1e-12, rtol=1e-10)


def test_torch_compile_of_a_model_has_no_graph_break() -> None:
    model = norm_model()
    x = torch.randn(4, 3, 6, 6, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break raises
    y, y_eager = compiled(x), model(x_eager)
    torch.testing.assert_close(y, y_eager, atol=1e-5, rtol=1e-5)
    y.square().sum().backward()
    y_eager.square().sum().backward()
    torch.testing.assert_close(x.grad, x_eager.grad, atol=1e-5, rtol=1e-5)
