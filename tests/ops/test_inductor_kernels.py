"""What is particular to the ``inductor`` backend (``lightning_mrs.ops.inductor_kernels``):
the eager fallback when compiling fails, input errors that must not be mistaken for a compile
failure, and compiled code reused across batch sizes. Its results against the float64
reference are in ``test_backends.py``.
"""

from __future__ import annotations

import os
import shutil
import types
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

from lightning_mrs import MRSNorm2d, mrs_norm
from lightning_mrs.ops import dispatch, inductor_kernels, torch_kernels, which_backend
from lightning_mrs.ops.layout import Layout
from helpers.checks import assert_matches_reference, forced, grads, make_inputs

# Inductor's CPU code needs a C++ compiler; without one the backend runs the eager bodies
needs_compiler = pytest.mark.skipif(
    not any(shutil.which(name) for name in (os.environ.get("CXX", "c++"), "g++", "clang++")),
    reason="no C++ compiler: Inductor cannot compile for the CPU",
)


@pytest.fixture
def fresh_compile_state() -> Iterator[None]:
    """No compile failure recorded, and the compiled functions and choices restored after."""
    saved_failed, saved_compiled = list(inductor_kernels._FAILED), dict(inductor_kernels._COMPILED)
    inductor_kernels._FAILED.clear()
    dispatch.clear_cache()
    yield
    inductor_kernels._FAILED[:] = saved_failed
    inductor_kernels._COMPILED.clear()
    inductor_kernels._COMPILED.update(saved_compiled)
    dispatch.clear_cache()


@needs_compiler
def test_the_recompile_limit_falls_back_for_new_variants_only(
    fresh_compile_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Dynamo raises FailOnRecompileLimitHit (fullgraph=True) once a body has its limit of
    # variants: the new variant runs eagerly, the backend stays enabled for the others
    monkeypatch.setattr(inductor_kernels, "_RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(inductor_kernels, "_LIMITED", set())
    inductor_kernels._COMPILED.clear()
    for name in ("fwd_last", "bwd_last"):  # fresh code objects: Dynamo counts variants per code object
        body = torch_kernels.BODIES[name]
        copy = types.FunctionType(body.__code__.replace(), body.__globals__, name, body.__defaults__, body.__closure__)
        monkeypatch.setitem(torch_kernels.BODIES, name, copy)
    x, w, gy = make_inputs((5, 7, 64), -1, None, torch.float32)
    first = grads(forced("inductor"), x, w, gy)  # compiles the forward and backward bodies
    x16, w16, gy16 = (t.to(torch.float16) for t in (x, w, gy))  # another dtype: a new variant
    with pytest.warns(RuntimeWarning, match="reached Dynamo's limit of 1 variants"):
        second = grads(forced("inductor"), x16, w16, gy16)
    assert inductor_kernels.compile_failed() is None
    assert_matches_reference(first, x, w, gy, -1, False)
    assert_matches_reference(second, x16, w16, gy16, -1, False)


class _CxxFailed(Exception):
    """Stands for Inductor's CppCompileError (matched by name, as the backend does)."""


_CxxFailed.__name__ = "CppCompileError"


def test_a_compiler_failure_falls_back_to_eager_with_one_warning(
    fresh_compile_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        try:
            raise _CxxFailed("g++: internal compiler error (simulated)")
        except _CxxFailed as inner:  # Dynamo wraps the compiler's error
            raise RuntimeError("backend='inductor' raised: CppCompileError") from inner

    monkeypatch.setattr(inductor_kernels, "_compiled", lambda name: broken)
    x, w, gy = make_inputs((5, 7, 64), -1, None, torch.float32)
    with pytest.warns(RuntimeWarning, match="compiler failed while compiling"):
        got = grads(forced("inductor"), x, w, gy)
    assert "simulated" in inductor_kernels.compile_failed()
    assert_matches_reference(got, x, w, gy, -1, False)  # the eager bodies took over
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process, not per call
        again = grads(forced("inductor"), x, w, gy)
    assert_matches_reference(again, x, w, gy, -1, False)
    # and auto no longer picks the compiled path, even for a large tensor
    monkeypatch.setenv("LIGHTNING_MRS_COMPILE_MIN_NUMEL", "64")
    dispatch.clear_cache()
    assert which_backend(torch.randn(2, 64, 4, 4), channel_dim=1) == "torch"


def test_other_compiled_failures_are_raised_not_swallowed(
    fresh_compile_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise AssertionError("an Inductor lowering bug (simulated)")

    monkeypatch.setattr(inductor_kernels, "_compiled", lambda name: broken)
    x, w, gy = make_inputs((5, 7, 64), -1, None, torch.float32)
    with pytest.raises(RuntimeError, match=r"'fwd_last' \(backend 'inductor'\) failed: AssertionError.*backend='torch'"):
        grads(forced("inductor"), x, w, gy)
    assert inductor_kernels.compile_failed() is None  # the next call tries the compiled body again


def test_out_of_memory_is_raised_as_it_is(fresh_compile_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    eager_calls = []

    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(inductor_kernels, "_compiled", lambda name: out_of_memory)
    monkeypatch.setitem(torch_kernels.BODIES, "fwd_last", lambda *a: eager_calls.append(a))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        inductor_kernels.forward(torch.randn(4, 1, 8), None, 1e-6, Layout(last=True, spatial=False))
    assert eager_calls == [] and inductor_kernels.compile_failed() is None


def test_auto_skips_inductor_without_a_compiler(fresh_compile_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inductor_kernels.cpp_build, "compiler", lambda: None)
    inductor_kernels._toolchain.cache_clear()
    try:
        monkeypatch.setenv("LIGHTNING_MRS_COMPILE_MIN_NUMEL", "64")
        monkeypatch.setenv("LIGHTNING_MRS_CPU_KERNELS", "0")
        dispatch.clear_cache()
        x = torch.randn(2, 64, 4, 4)
        assert which_backend(x, channel_dim=1) == "torch"
        with pytest.raises(ValueError, match="no C\\+\\+ compiler found"):
            mrs_norm(x, backend="inductor")
    finally:
        inductor_kernels._toolchain.cache_clear()
        dispatch.clear_cache()


def test_input_errors_are_not_swallowed_by_the_fallback(fresh_compile_state: None) -> None:
    # a weight of the wrong width reaches the kernel only when called directly (mrs_norm checks
    # it first): the compiled call fails, the eager retry fails the same way and that error is
    # raised as it is, without disabling the compiled path
    x3 = torch.randn(4, 1, 8)  # (A, L, C)
    with pytest.raises(RuntimeError, match="size of tensor"):
        inductor_kernels.forward(x3, torch.ones(6), 1e-6, Layout(last=True, spatial=False))
    assert inductor_kernels.compile_failed() is None
    with pytest.raises(ValueError, match="even"):
        mrs_norm(torch.randn(512, 63), backend="inductor")
    assert inductor_kernels.compile_failed() is None


@needs_compiler
def test_fewer_rows_than_the_weight_gradient_block_keeps_the_compiled_path() -> None:
    # 5 rows < the 8-row blocks of the dw column sum (torch_kernels._col_sum): must compile,
    # not fall back to the eager bodies
    x, w, gy = make_inputs((5, 64), -1, None, torch.float32)
    got = grads(forced("inductor"), x, w, gy)
    assert inductor_kernels.compile_failed() is None
    assert_matches_reference(got, x, w, gy, -1, False)


@needs_compiler
def test_new_batch_sizes_do_not_recompile() -> None:
    norm = MRSNorm2d(64, spatial=True)
    norm.backend = "inductor"

    def step(batch: int) -> None:
        x = torch.randn(batch, 64, 5, 7, requires_grad=True)
        norm(x).sum().backward()

    step(16)  # compiles (or reuses) the graphs of this shape family
    before = counters["stats"]["unique_graphs"]
    for batch in (24, 40, 64):  # multiples of 8: the same specialisation of the dw sums
        step(batch)
    assert counters["stats"]["unique_graphs"] == before
    assert inductor_kernels.compile_failed() is None
