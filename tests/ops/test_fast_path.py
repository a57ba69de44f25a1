"""The op's fast path, the operator pair with its C++ CPU kernels (``lightning_mrs.ops.library``):
which inputs take it (``auto`` and ``backend="cpp"`` alike), that every other input takes the
fallback pair or the formula with every check, and that its results (output, both gradients,
double backward) equal the float64 reference in every dtype it covers."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
from torch import Tensor

from lightning_mrs import MRSNorm, mrs_norm
import importlib

from lightning_mrs.ops import dispatch
from lightning_mrs.ops.dispatch import route_for
from lightning_mrs.ops.library import MRSNormFunction
from helpers.checks import assert_matches_reference, grads, make_inputs, needs_cpp
from helpers.reference import mrs_norm_ref

pytestmark = needs_cpp

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def fast_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per call that the router sent to the operator pair: ``True`` when through the
    autograd Function, ``False`` for the forward operator alone."""
    calls: list[bool] = []
    router = importlib.import_module("lightning_mrs.ops.mrs_norm")  # the package's mrs_norm is the function
    real_op, real_apply = router.FWD, MRSNormFunction.apply

    def op(*args: object) -> tuple[Tensor, Tensor]:
        calls.append(False)
        return real_op(*args)

    def apply(*args: object) -> Tensor:
        if args[5] is None:  # fallback=None: the operator pair
            calls.append(True)
        return real_apply(*args)

    monkeypatch.setattr(router, "FWD", op)
    monkeypatch.setattr(router.MRSNormFunction, "apply", apply)
    return calls


@pytest.mark.parametrize("wdtype", [None, "same", torch.float32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (8, 64), (3, 5, 30), (2, 2)])
def test_common_case_takes_the_fast_path_and_matches_the_reference(
    shape: tuple[int, ...], dtype: torch.dtype, wdtype: object, fast_calls: list[bool]
) -> None:
    x, w, gy = make_inputs(shape, -1, None, dtype, affine=wdtype is not None)
    if w is not None and wdtype is torch.float32:
        w = w.float()  # fp32 weights beside half activations (mixed precision)
    got = grads(lambda a, b: mrs_norm(a, b), x, w, gy)
    assert fast_calls == [True]  # autograd: the Function
    assert_matches_reference(got, x, w, gy, -1, False)
    with torch.inference_mode():
        y = mrs_norm(x, w)
    assert fast_calls == [True, False]  # no autograd: the kernel alone, no S kept
    torch.testing.assert_close(y, got[0], atol=0, rtol=0)


def test_module_decoding_step_takes_the_fast_path(fast_calls: list[bool]) -> None:
    norm = MRSNorm(64)
    with torch.no_grad():
        norm(torch.randn(1, 1, 64))
    assert fast_calls == [False]


# (what, make (x, w, kwargs)) of inputs that take the operator pair too (the C++ kernel reads any
# dense layout with the channels contiguous, or NCHW per sample, and converts any weight)
def _tokens(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, dtype=dtype)


ON_THE_OPERATOR: list[tuple[str, Callable[[], tuple[Tensor, Optional[Tensor], dict]]]] = [
    ("transposed", lambda: (_tokens(5, 4, 8).transpose(0, 1), None, {})),
    ("spatial", lambda: (_tokens(2, 3, 8), None, {"spatial": True})),
    ("nchw per sample", lambda: (_tokens(2, 8, 3), None, {"channel_dim": 1, "spatial": True})),
    ("explicit backend", lambda: (_tokens(4, 8), None, {"backend": "cpp"})),
    ("float64 weight", lambda: (_tokens(4, 8), torch.rand(4, dtype=torch.float64) + 0.5, {})),
    ("strided weight", lambda: (_tokens(4, 8), (torch.rand(8) + 0.5)[::2], {})),
]
# ... and those that must not
GENERAL: list[tuple[str, Callable[[], tuple[Tensor, Optional[Tensor], dict]]]] = [
    ("float64", lambda: (_tokens(4, 8, dtype=torch.float64), None, {})),
    ("strided", lambda: (_tokens(4, 16)[:, ::2], None, {})),
    ("one dim", lambda: (_tokens(8), None, {})),
    ("channels first", lambda: (_tokens(2, 8, 3), None, {"channel_dim": 1})),
    ("torch backend", lambda: (_tokens(4, 8), None, {"backend": "torch"})),
    ("eager backend", lambda: (_tokens(4, 8), None, {"backend": "eager"})),
    ("empty", lambda: (_tokens(0, 8), None, {})),
]


@pytest.mark.parametrize("on_op,what,make", [(True, *c) for c in ON_THE_OPERATOR] + [(False, *c) for c in GENERAL],
                         ids=[c[0] for c in ON_THE_OPERATOR + GENERAL])
def test_other_inputs_take_the_operator_or_the_general_path(on_op: bool, what: str, make: Callable,
                                                            fast_calls: list[bool]) -> None:
    x, w, kwargs = make()
    y = mrs_norm(x, w, **kwargs)
    assert fast_calls == ([False] if on_op else [])
    ref = mrs_norm_ref(x.double(), None if w is None else w.double(), channel_dim=kwargs.get("channel_dim", -1),
                       spatial=kwargs.get("spatial", False))
    torch.testing.assert_close(y.double(), ref, atol=2e-5, rtol=2e-5)


# (what, x, weight, eps, the words of the error) on contiguous channels-last CPU tokens: the
# fast path's own domain, so its checks must send each of them on to the general path's errors
ERRORS = [
    ("odd channels", lambda: torch.randn(4, 7), None, 1e-6, "must be even"),
    ("weight width", lambda: torch.randn(4, 8), torch.ones(3), 1e-6, r"shape \(4,\)"),
    ("weight 2-d", lambda: torch.randn(4, 8), torch.ones(4, 1), 1e-6, r"shape \(4,\)"),
    ("integer weight", lambda: torch.randn(4, 8), torch.ones(4, dtype=torch.int64), 1e-6, "floating-point"),
    ("meta weight", lambda: torch.randn(4, 8), torch.ones(4, device="meta"), 1e-6, "meta device"),
    ("zero eps", lambda: torch.randn(4, 8), None, 0.0, "eps must be > 0"),
    ("integer input", lambda: torch.ones(4, 8, dtype=torch.int64), None, 1e-6, "floating-point"),
]


@pytest.mark.parametrize("what,make,w,eps,words", ERRORS, ids=[c[0] for c in ERRORS])
def test_every_check_still_fires_on_the_fast_paths_inputs(what: str, make: Callable, w: Optional[Tensor],
                                                          eps: float, words: str) -> None:
    with pytest.raises((ValueError, RuntimeError), match=words):
        mrs_norm(make(), w, eps)
    with torch.inference_mode(), pytest.raises((ValueError, RuntimeError), match=words):
        mrs_norm(make(), w, eps)


def test_no_fast_path_when_auto_would_not_run_the_cpp_kernels(
    monkeypatch: pytest.MonkeyPatch, fast_calls: list[bool]
) -> None:
    monkeypatch.setenv("LIGHTNING_MRS_CPU_KERNELS", "0")
    dispatch.clear_cache()
    try:
        x = torch.randn(4, 8)
        torch.testing.assert_close(mrs_norm(x), mrs_norm(x, backend="eager"))
        assert fast_calls == []
    finally:
        monkeypatch.delenv("LIGHTNING_MRS_CPU_KERNELS")
        dispatch.clear_cache()


@pytest.mark.parametrize("need", ["x", "weight"])
def test_only_the_gradients_asked_for(need: str) -> None:
    x, w, gy = make_inputs((3, 8), -1, None, torch.float32)
    x.requires_grad_(need == "x")
    w.requires_grad_(need == "weight")
    mrs_norm(x, w).backward(gy)
    ref_x, ref_w = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    mrs_norm_ref(ref_x, ref_w).backward(gy.double())
    got, ref = (x, ref_x) if need == "x" else (w, ref_w)
    torch.testing.assert_close(got.grad.double(), ref.grad, atol=2e-4, rtol=2e-4)
    assert (w if need == "x" else x).grad is None


def test_double_backward_equals_the_reference_formulas() -> None:
    x, w, gy = make_inputs((4, 8), -1, None, torch.float32)

    def second(norm: Callable, x: Tensor, w: Tensor) -> tuple[Tensor, ...]:
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        dx, dw = torch.autograd.grad(norm(x, w), (x, w), gy, create_graph=True)
        return torch.autograd.grad((dx.square().sum() + dw.square().sum()), (x, w))

    route = route_for(x, w, 1e-6, -1, False, "auto")
    assert route.kernel == "cpp" and route.fallback is None
    got = second(lambda a, b: mrs_norm(a, b), x, w)
    ref = second(lambda a, b: mrs_norm_ref(a, b), x.double(), w.double())
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r, atol=1e-3, rtol=1e-3)


def test_saves_x_the_weight_and_one_scale_per_row() -> None:
    from helpers.checks import saved_bytes

    x, w, _ = make_inputs((6, 5, 64), -1, None, torch.float32)
    w.requires_grad_()
    _, nbytes = saved_bytes(lambda t: mrs_norm(t, w), x.requires_grad_())
    assert nbytes == x.numel() * 4 + w.numel() * 4 + 6 * 5 * 4
