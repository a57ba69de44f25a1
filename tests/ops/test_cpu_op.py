"""The operator pair's C++ CPU kernels (``cpu_kernels.cpp``, built by ``lightning_mrs.ops.cpu_kernels``) in
compiled graphs: chosen exactly where an eager call runs them, equal to the eager op to the last bit
(the same kernels) and so to the float64 reference, true to their fake kernels, clear about bad calls,
following the kernel set in use, and replaced by the fallback pair where they cannot be built."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import Tensor, nn

from lightning_mrs import MRSNorm, mrs_norm
from lightning_mrs.ops import cpu_kernels, dispatch
from helpers.checks import assert_matches_reference, grads, make_inputs, needs_cpp
from helpers.compiled import aot_graphs

pytestmark = needs_cpp

ROWS_FWD, ROWS_BWD = "lightning_mrs.mrs_norm_fwd.default", "lightning_mrs.mrs_norm_bwd.default"
GENERAL_FWD, GENERAL_BWD = "lightning_mrs.mrs_norm_fwd_fallback.default", "lightning_mrs.mrs_norm_bwd_fallback.default"
FWD, BWD = torch.ops.lightning_mrs.mrs_norm_fwd.default, torch.ops.lightning_mrs.mrs_norm_bwd.default


def _norm(a: Tensor, b: Optional[Tensor]) -> Tensor:
    return mrs_norm(a, b)


def _targets(fn, *args: Optional[Tensor]) -> tuple[list[str], list[str]]:
    """The forward and backward graphs' call targets, every tensor argument a leaf that requires grad."""
    graphs = aot_graphs(fn, *(None if a is None else a.detach().requires_grad_() for a in args))
    return graphs["fw"], graphs["bw"]


def test_token_models_compile_to_the_cpp_operators_and_nothing_else() -> None:
    model = nn.Sequential(nn.Linear(64, 64), MRSNorm(64), nn.Linear(64, 64), MRSNorm(64, affine=False))
    fw, bw = _targets(model, torch.randn(3, 5, 64))
    assert fw.count(ROWS_FWD) == 2 and bw.count(ROWS_BWD) == 2
    assert GENERAL_FWD not in fw and GENERAL_BWD not in bw


# what an eager call runs on the C++ kernels besides tokens, and what it runs elsewhere: the fallback pair
OP_CASES = {
    "spatial": (lambda a: mrs_norm(a, channel_dim=1, spatial=True), (2, 8, 3, 3)),
    "nhwc": (lambda a: mrs_norm(a.contiguous(memory_format=torch.channels_last), channel_dim=1), (2, 8, 3, 3)),
    "forced_cpp": (lambda a: mrs_norm(a, backend="cpp"), (4, 16)),
}
GENERAL_CASES = {
    "channels_first": (lambda a: mrs_norm(a, channel_dim=1), (2, 8, 5)),
    "forced_torch": (lambda a: mrs_norm(a, backend="torch"), (4, 16)),
    "float64": (lambda a: mrs_norm(a), (4, 16)),
    "gaps": (lambda a: mrs_norm(a[:, :16]), (4, 32)),
}


@pytest.mark.parametrize("case", list(OP_CASES) + list(GENERAL_CASES))
def test_other_calls_keep_their_eager_pair(case: str) -> None:
    fn, shape = {**OP_CASES, **GENERAL_CASES}[case]
    dtype = torch.float64 if case == "float64" else torch.float32
    fw, bw = _targets(fn, torch.randn(shape, dtype=dtype, requires_grad=True))
    on_op = case in OP_CASES
    assert (ROWS_FWD in fw and ROWS_BWD in bw) == on_op
    assert (GENERAL_FWD in fw and GENERAL_BWD in bw) == (not on_op)


# (shape, x dtype, weight: None / "same" / a dtype) - odd row counts, mixed-precision weights
CASES = [((5, 7, 64), torch.float32, "same"), ((3, 66), torch.float32, None), ((1, 2), torch.float32, "same"),
         ((4, 9, 128), torch.bfloat16, "same"), ((4, 9, 128), torch.bfloat16, torch.float32),
         ((6, 34), torch.float16, "same"), ((6, 34), torch.float16, None), ((2, 3, 5, 24), torch.float16, torch.float32)]


@pytest.mark.parametrize("shape,dtype,weight", CASES, ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}-{w if w is None or w == 'same' else str(w)[6:]}"
                                                           for s, d, w in CASES])
def test_compiled_rows_equal_the_eager_op_and_the_reference(shape: tuple, dtype: torch.dtype, weight) -> None:
    x, w, gy = make_inputs(shape, -1, None, dtype, affine=weight is not None)
    if weight not in (None, "same"):
        w = w.to(weight)
    fw, bw = _targets(_norm, x, w)
    assert ROWS_FWD in fw and ROWS_BWD in bw
    torch._dynamo.reset()
    got = grads(torch.compile(_norm, fullgraph=True), x, w, gy)  # Inductor
    eager = grads(_norm, x, w, gy)
    for g, e in zip(got, eager):
        if e is None:
            assert g is None
        else:  # the same kernels: equal to the last bit, in the same dtype
            torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert_matches_reference(got, x, w, gy, -1, False)


@pytest.mark.parametrize("frozen", ["weight", "input"])
def test_a_frozen_weight_or_input_gets_no_gradient_and_the_other_the_eager_one(frozen: str) -> None:
    x, w, gy = make_inputs((4, 32), -1, None, torch.float32)

    def run(fn) -> tuple[Optional[Tensor], Optional[Tensor]]:
        xl, wl = x.clone().requires_grad_(frozen != "input"), w.clone().requires_grad_(frozen != "weight")
        fn(xl, wl).backward(gy)
        return xl.grad, wl.grad

    torch._dynamo.reset()
    got, want = run(torch.compile(_norm, fullgraph=True, backend="aot_eager")), run(_norm)
    assert (got[0] is None) == (frozen == "input") and (got[1] is None) == (frozen == "weight")
    for g, e in zip(got, want):
        if e is not None:
            torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_dynamic_shapes_keep_the_cpp_operators() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_norm, fullgraph=True, dynamic=True)
    w = torch.rand(32) + 0.5
    for rows in (3, 11, 1):
        x, _, gy = make_inputs((2, rows, 64), -1, None, torch.float32, seed=rows)
        for g, e in zip(grads(compiled, x, w, gy), grads(_norm, x, w, gy)):
            torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_opcheck_fake_kernels_of_the_cpp_operators() -> None:
    x, w, gy = make_inputs((3, 5, 64), -1, None, torch.float32)
    y, r_sum = FWD(x, w, 1e-6, 2, False)
    # no input requires grad: the operators have no autograd kernel (the Function is their
    # autograd), the checks of schema and fake kernels still run
    torch.library.opcheck(FWD, (x, w, 1e-6, 2, False))
    torch.library.opcheck(FWD, (x.to(torch.bfloat16), None, 1e-6, 2, False))
    torch.library.opcheck(FWD, (x, w, 1e-6, 2, True))  # one S per sample: the rows of a sample together
    for need in (True, False):
        torch.library.opcheck(BWD, (gy, x, w, r_sum, 1e-6, 2, False, need))
    assert r_sum.dtype == torch.float32 and r_sum.shape == (15,)
    nchw, _, g4 = make_inputs((2, 64, 3, 5), 1, None, torch.bfloat16)  # the per-sample kernels
    _, r4 = FWD(nchw, w, 1e-6, 1, True)
    torch.library.opcheck(FWD, (nchw, w, 1e-6, 1, True))
    torch.library.opcheck(BWD, (g4, nchw, w, r4, 1e-6, 1, True, True))
    assert r4.shape == (2,)


def test_bad_calls_raise_errors_that_name_the_operator_and_the_fix() -> None:
    x, w, gy = make_inputs((4, 32), -1, None, torch.float32)
    with pytest.raises(RuntimeError, match="mrs_norm_fwd: the C\\+\\+ kernels need the channels contiguous.*mrs_norm"):
        FWD(x.t(), None, 1e-6, 1, False)
    with pytest.raises(RuntimeError, match="channel_dim 1 of shape \\[2, 7\\] must hold an even number of channels"):
        FWD(torch.randn(2, 7), None, 1e-6, 1, False)
    with pytest.raises(RuntimeError, match=r"weight must be a \(C // 2,\) = \(16,\)"):
        FWD(x, torch.ones(15), 1e-6, 1, False)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16, not Double"):
        FWD(x.double(), None, 1e-6, 1, False)
    _, r_sum = FWD(x, w, 1e-6, 1, False)
    with pytest.raises(RuntimeError, match="r_sum must be mrs_norm_fwd's contiguous float32"):
        BWD(gy, x, w, r_sum.double(), 1e-6, 1, False, True)
    with pytest.raises(RuntimeError, match="grad must have x's shape"):
        BWD(gy[:2], x, w, r_sum, 1e-6, 1, False, True)


def test_a_gradient_of_another_dtype_or_layout_is_taken_as_the_eager_op_takes_it() -> None:
    x, w, gy = make_inputs((8, 32), -1, None, torch.bfloat16)
    _, r_sum = FWD(x, w, 1e-6, 1, False)
    g32 = gy.float().t().contiguous().t()  # float32, column-major
    got = BWD(g32, x, w, r_sum, 1e-6, 1, False, True)
    want = BWD(gy, x, w, r_sum, 1e-6, 1, False, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert got[1].dtype == torch.bfloat16  # the weight's dtype


def test_compiled_graphs_run_the_kernel_set_in_use() -> None:
    x, w, _ = make_inputs((64, 256), -1, None, torch.float16)
    with cpu_kernels.using("generic"):
        generic = _norm(x, w)
    default = _norm(x, w)
    if torch.equal(generic, default):
        pytest.skip("the generic and default kernels agree to the last bit here: nothing to tell apart")
    torch._dynamo.reset()
    compiled = torch.compile(_norm, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), default, atol=0, rtol=0)
    with cpu_kernels.using("generic"):
        torch.testing.assert_close(compiled(x, w), generic, atol=0, rtol=0)
    torch.testing.assert_close(compiled(x, w), default, atol=0, rtol=0)  # and back after the block


@pytest.fixture
def fresh_routes() -> None:
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()  # choices made without the C++ kernels must not outlive the test


def test_without_the_cpp_kernels_compiled_graphs_call_the_fallback_ops(monkeypatch: pytest.MonkeyPatch,
                                                                        fresh_routes: None) -> None:
    monkeypatch.setenv("LIGHTNING_MRS_CPU_KERNELS", "0")
    x, w, gy = make_inputs((4, 32), -1, None, torch.float32)
    fw, bw = _targets(_norm, x, w)
    assert GENERAL_FWD in fw and GENERAL_BWD in bw and ROWS_FWD not in fw


def test_a_failed_build_warns_once_and_leaves_the_fallback_ops(monkeypatch: pytest.MonkeyPatch,
                                                                fresh_routes: None) -> None:
    def fail() -> None:
        raise RuntimeError("no torch headers")

    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setattr(cpu_kernels, "_build", fail)
    with pytest.warns(RuntimeWarning, match="building the one-pass CPU kernels failed.*no torch headers"):
        assert not cpu_kernels.available()
    assert "no torch headers" in cpu_kernels.build_error()
    assert not cpu_kernels.available()  # once: no second warning, no second build
    x, w, _ = make_inputs((4, 32), -1, None, torch.float32)
    fw, _ = _targets(_norm, x, w)
    assert GENERAL_FWD in fw and ROWS_FWD not in fw
