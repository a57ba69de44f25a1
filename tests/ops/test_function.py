"""The fused MRSNorm (``lightning_mrs.fused``) against the independent float64 reference.

Forward, input gradient and weight gradient of the Inductor-compiled path and of the
eager-bodied ``"function"`` path (the hand-written CPU kernels: test_kernels_cpu.py), for every layout the kernels distinguish; saved memory;
dispatch; the fallback when compilation fails. Compiling costs seconds per new
(layout, dtype) so the compiled cases share few channel widths (the module-level cache of
``kernels_inductor`` reuses them, and the batch dim is dynamic).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck, gradgradcheck

from lightning_mrs import MRSNorm, MRSNorm2d, mrs_norm
from lightning_mrs import fused
from lightning_mrs import kernels_cpu as kc
from lightning_mrs import kernels_inductor as ki
from helpers.checks import TOLS, check_against_reference, grads, make_inputs, saved_bytes
from helpers.reference import mrs_norm_ref

# name -> (shape, channel_dim, spatial, memory_format); odd sizes on purpose
LAYOUTS = {
    "tokens": ((5, 7, 64), -1, False, None),
    "tokens_per_sample": ((3, 7, 64), -1, True, None),
    "nchw_per_position": ((3, 64, 5, 7), 1, False, None),
    "nchw_per_sample": ((3, 64, 5, 7), 1, True, None),
    "nhwc_per_position": ((3, 64, 5, 7), 1, False, torch.channels_last),
    "nhwc_per_sample": ((3, 64, 5, 7), 1, True, torch.channels_last),
    "middle_dim": ((3, 4, 64, 5), 2, False, None),
}


def _check_against_reference(backend, layout, dtype, affine=True):
    check_against_reference(backend, LAYOUTS[layout], dtype, affine)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_inductor_matches_reference_float32(layout):
    _check_against_reference("inductor", layout, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["tokens", "nchw_per_sample"])
def test_inductor_half_precision_computed_in_float32(layout, dtype):
    _check_against_reference("inductor", layout, dtype)


@pytest.mark.parametrize("layout", ["tokens", "nchw_per_position"])
def test_inductor_without_weight(layout):
    _check_against_reference("inductor", layout, torch.float32, affine=False)


def test_inductor_fewer_rows_than_the_dw_block_keeps_the_compiled_path():
    # 5 rows < the 8-row blocks of the dw column sum: must compile, not disable Inductor
    x, w, gy = make_inputs((5, 64), -1, None, torch.float32)
    y, dx, dw = grads(lambda a, b: mrs_norm(a, b, backend="inductor"), x, w, gy)
    y_r, dx_r, dw_r = grads(mrs_norm_ref, x.double(), w.double(), gy.double())
    assert ki.compile_failed() is None
    atol, rtol = TOLS[torch.float32]
    torch.testing.assert_close(y.double(), y_r, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx.double(), dx_r, atol=atol * 10, rtol=rtol * 10)
    torch.testing.assert_close(dw.double(), dw_r, atol=atol * 10 * dw_r.abs().max().item(), rtol=rtol * 10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_function_path_matches_reference(layout, dtype):
    _check_against_reference("function", layout, dtype)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_float64_function_path(layout, affine):
    shape, cd, spatial, mf = LAYOUTS[layout]
    shape = tuple(min(s, 3) if i != (cd % len(shape)) else 6 for i, s in enumerate(shape))
    x, w, _ = make_inputs(shape, cd, mf, torch.float64, affine)
    inputs = (x.requires_grad_(),) + ((w.requires_grad_(),) if affine else ())
    fn = lambda *a: mrs_norm(*a, channel_dim=cd, spatial=spatial, backend="function")  # noqa: E731
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7)
    assert gradgradcheck(fn, inputs, eps=1e-6, atol=1e-6)


def test_default_modules_pick_the_fused_path_and_save_only_x_and_one_scale_per_group():
    # the hand-written CPU kernels where they cover the layout (and could be built)
    cpp = "cpp" if kc.available() else None
    big = fused.COMPILE_MIN_NUMEL
    cases = [
        (MRSNorm(64), torch.randn(big // 64, 64), cpp or "inductor"),
        (MRSNorm2d(64, spatial=True), torch.randn(big // 1024, 64, 4, 4), cpp or "inductor"),
        (MRSNorm2d(64), torch.randn(big // 1024, 64, 4, 4), "inductor"),  # NCHW per position
        (MRSNorm(64), torch.randn(8, 64), cpp or "function"),  # tiny: not worth a compile
        (MRSNorm2d(64), torch.randn(2, 64, 4, 4), "function"),
        (MRSNorm(64).double(), torch.randn(big // 64, 64, dtype=torch.float64), "function"),
    ]
    for norm, x, expected in cases:
        cd = -1 if isinstance(norm, MRSNorm) else 1
        spatial = getattr(norm, "spatial", False)
        assert fused.resolve_backend(x, cd % x.ndim, spatial, "auto") == expected
        x = x.requires_grad_()
        y, nbytes = saved_bytes(norm, x)
        groups = x.shape[0] if spatial else x.numel() // x.shape[cd]
        # x itself + the weight + one fp32/fp64 value per group, nothing else
        budget = x.numel() * x.element_size() + norm.weight.numel() * norm.weight.element_size()
        assert nbytes <= budget + groups * x.element_size()
        y.sum().backward()
        assert torch.isfinite(x.grad).all()


def test_new_batch_sizes_do_not_recompile():
    from torch._dynamo.utils import counters

    norm = MRSNorm2d(64, spatial=True)
    norm.backend = "inductor"

    def step(n):
        x = torch.randn(n, 64, 5, 7, requires_grad=True)
        norm(x).sum().backward()

    step(16)  # compiles (or reuses) the graphs of this shape family
    before = counters["stats"]["unique_graphs"]
    for n in (24, 40, 64):  # multiples of 8: the same graphs
        step(n)
    assert counters["stats"]["unique_graphs"] == before


def test_zeros_give_zeros_and_finite_gradients():
    for backend in ("inductor", "function"):
        x = torch.zeros(4, 64, 5, 7, requires_grad=True)
        w = torch.ones(32, requires_grad=True)
        y = mrs_norm(x, w, channel_dim=1, spatial=True, backend=backend)
        y.sum().backward()
        assert (y == 0).all()
        assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_inplace_activation_after_the_norm():
    # the Function's output must not be a view, or relu_ on it is refused by autograd
    for backend in ("inductor", "function"):
        x = torch.randn(3, 64, 5, 7, requires_grad=True)
        norm = MRSNorm2d(64)
        norm.backend = backend
        y = norm(x)
        assert y._base is None  # no view: in-place ops need no CopySlices in the backward
        y = torch.relu_(y)
        y.sum().backward()
        ref = torch.relu(mrs_norm_ref(x.detach(), norm.weight.detach(), channel_dim=1))
        torch.testing.assert_close(y.detach().double(), ref, atol=2e-5, rtol=2e-5)


def test_torch_compile_of_a_model_has_no_graph_break():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8, spatial=True), nn.ReLU(), MRSNorm2d(8),
        nn.Flatten(), nn.Linear(8 * 6 * 6, 16), MRSNorm(16),
    )
    x = torch.randn(4, 3, 6, 6)
    ref = model(x)
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break would raise
    y = compiled(x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    y.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="auto, eager, function, inductor, cpp, triton"):
        mrs_norm(torch.randn(2, 8), backend="cuda")


def test_triton_backend_on_cpu_says_what_it_needs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA tensor"):
        mrs_norm(torch.randn(2, 8), backend="triton")


@pytest.fixture
def fresh_compile_state():
    saved_failed, saved_compiled = list(ki._FAILED), dict(ki._COMPILED)
    ki._FAILED.clear()
    yield
    ki._FAILED[:] = saved_failed
    ki._COMPILED.clear()
    ki._COMPILED.update(saved_compiled)


def test_compile_failure_falls_back_to_eager_with_one_warning(fresh_compile_state, monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler found (simulated)")

    monkeypatch.setattr(ki, "_get", lambda name: broken)
    x, w, gy = make_inputs((5, 7, 64), -1, None, torch.float32)
    with pytest.warns(RuntimeWarning, match="falling back to the eager implementation"):
        y, dx, dw = grads(lambda a, b: mrs_norm(a, b, backend="inductor"), x, w, gy)
    assert "simulated" in ki.compile_failed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process, not per call
        y2 = mrs_norm(x, w, backend="inductor")
    ref = mrs_norm_ref(x, w)
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(y2.double(), ref, atol=2e-5, rtol=2e-5)
    # and auto no longer picks the compiled path (NCHW per position: no hand-written kernel)
    big = torch.randn(fused.COMPILE_MIN_NUMEL // 1024, 64, 4, 4)
    assert fused.resolve_backend(big, 1, False, "auto") == "function"


def test_input_errors_are_not_swallowed_by_the_fallback(fresh_compile_state):
    with pytest.raises(ValueError, match="even"):
        mrs_norm(torch.randn(512, 63), backend="inductor")
    assert ki.compile_failed() is None
