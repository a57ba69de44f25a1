"""The choice of a backend (``lightning_mrs.ops.dispatch``): what ``auto`` picks per key, the
reasons an explicit request is refused, the cache of choices and the environment variables.

Dispatching runs no kernel, so the "large" cases lower the compile threshold through
``LIGHTNING_MRS_COMPILE_MIN_NUMEL`` instead of allocating large tensors (one case keeps the
default threshold).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Callable, Optional

import pytest
import torch
from torch import Tensor

from lightning_mrs import mrs_norm
from lightning_mrs.ops import BACKENDS, cpu_kernels, dispatch, which_backend
from lightning_mrs.ops.layout import DispatchKey

CPP = "cpp" if cpu_kernels.available() else None  # where the C++ kernels cannot be built, ...
LARGE = 64  # elements from which these tests' tensors count as large


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No cached choice before and after each test (which also re-reads the environment)."""
    monkeypatch.delenv("LIGHTNING_MRS_CPU_KERNELS", raising=False)
    monkeypatch.setenv("LIGHTNING_MRS_COMPILE_MIN_NUMEL", str(LARGE))
    dispatch.clear_cache()
    yield
    dispatch.clear_cache()


def nchw(dtype: torch.dtype = torch.float32, n: int = 2, device: str = "cpu") -> Tensor:
    return torch.randn(n, 8, 3, 3, dtype=dtype, device=device)  # (N, C, H, W): 144 elements


# (what, input, channel_dim, spatial, expected; cpp falls back to inductor/torch where it cannot be built)
AUTO_CASES: list[tuple[str, Callable[[], Tensor], int, bool, str]] = [
    ("tokens float32", lambda: torch.randn(20, 8), -1, False, "cpp"),
    ("tokens bfloat16", lambda: torch.randn(20, 8, dtype=torch.bfloat16), -1, False, "cpp"),
    ("tokens per sample", lambda: torch.randn(2, 10, 8), -1, True, "cpp"),
    ("nchw per sample", lambda: nchw(), 1, True, "cpp"),
    ("nhwc per position", lambda: nchw().contiguous(memory_format=torch.channels_last), 1, False, "cpp"),
    ("nhwc per sample", lambda: nchw().contiguous(memory_format=torch.channels_last), 1, True, "cpp"),
    ("permuted channels last", lambda: nchw().permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), 1, True, "cpp"),
    # sequence-first tokens seen batch-first: dense (a view) per position, a copy per sample
    ("tokens transposed", lambda: torch.randn(10, 2, 8).transpose(0, 1), -1, False, "cpp"),
    ("tokens transposed per sample", lambda: torch.randn(10, 2, 8).transpose(0, 1), -1, True, "inductor"),
    ("nchw per position", lambda: nchw(), 1, False, "inductor"),  # no C++ kernel for it
    ("nchw per position small", lambda: torch.randn(1, 8, 2, 2), 1, False, "torch"),
    ("float16 large", lambda: nchw(torch.float16), 1, True, "cpp"),
    ("float16 small", lambda: torch.randn(2, 8, dtype=torch.float16), -1, False, "cpp"),
    ("float16 per position", lambda: nchw(torch.float16), 1, False, "inductor"),
    ("float64 large", lambda: nchw(torch.float64), 1, True, "torch"),
    ("strided slice large", lambda: torch.randn(20, 16)[:, ::2], -1, False, "inductor"),
    ("strided slice small", lambda: torch.randn(4, 16)[:, ::2], -1, False, "torch"),
    ("expanded batch large", lambda: torch.randn(1, 8, 3, 3).expand(4, -1, -1, -1), 1, True, "inductor"),
    ("meta", lambda: nchw(device="meta"), 1, True, "torch"),
]


@pytest.mark.parametrize("what,make,channel_dim,spatial,expected", AUTO_CASES, ids=[c[0] for c in AUTO_CASES])
def test_auto_picks_per_key(what: str, make: Callable[[], Tensor], channel_dim: int, spatial: bool,
                            expected: str) -> None:
    x = make()
    if expected == "cpp" and CPP is None:
        expected = "inductor" if x.numel() >= LARGE else "torch"
    assert which_backend(x, channel_dim=channel_dim, spatial=spatial) == expected


def test_the_default_compile_threshold_is_a_quarter_million_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_MRS_COMPILE_MIN_NUMEL")
    dispatch.clear_cache()
    big = torch.empty(2**18 // 64, 16, 2, 2)  # NCHW per position: Inductor's when large
    assert which_backend(big, channel_dim=1) == "inductor"
    assert which_backend(big[:-1], channel_dim=1) == "torch"


# (request, input, channel_dim, spatial, words of the reason)
REFUSALS = [
    ("cpp", lambda: torch.randn(4, 8, dtype=torch.float64), -1, False, "float32/bfloat16/float16, not torch.float64"),
    ("cpp", lambda: nchw(), 1, False, "channels contiguous, or the positions contiguous with spatial=True"),
    ("cpp", lambda: torch.randn(4, 16)[:, ::2], -1, False, "in a dense tensor"),
    ("cpp", lambda: nchw(device="meta"), 1, True, "run on the CPU, not on meta"),
    ("inductor", lambda: nchw(device="meta"), 1, True, "Inductor does not compile for meta tensors"),
    ("triton", lambda: nchw(), 1, True, "one S per position (spatial=False)"),
    ("triton", lambda: torch.randn(4, 8, dtype=torch.float64), -1, False, "not torch.float64"),
]


@pytest.mark.parametrize("request_,make,channel_dim,spatial,reason", REFUSALS,
                         ids=[f"{c[0]}-{c[4]}" for c in REFUSALS])
def test_explicit_request_that_cannot_run_raises_with_the_reason(
    request_: str, make: Callable[[], Tensor], channel_dim: int, spatial: bool, reason: str
) -> None:
    x = make()
    message = rf"backend='{request_}'.*{re.escape(reason)}.*backend='auto'"
    with pytest.raises(ValueError, match=message):
        mrs_norm(x, channel_dim=channel_dim, spatial=spatial, backend=request_)
    with pytest.raises(ValueError, match=message):  # which_backend says the same
        which_backend(x, channel_dim=channel_dim, spatial=spatial, backend=request_)


def test_triton_on_a_cpu_tensor_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need a CUDA tensor"):
        mrs_norm(torch.randn(2, 8), backend="triton")


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown backend 'cuda'; choose one of auto, eager, triton, cpp, inductor, torch"):
        mrs_norm(torch.randn(2, 8), backend="cuda")


@pytest.mark.parametrize("what,make,channel_dim,spatial,expected", AUTO_CASES, ids=[c[0] for c in AUTO_CASES])
def test_every_answer_of_which_backend_is_a_valid_backend(
    what: str, make: Callable[[], Tensor], channel_dim: int, spatial: bool, expected: str
) -> None:
    x = make()
    name = which_backend(x, channel_dim=channel_dim, spatial=spatial)
    assert name in BACKENDS
    # accepted as a request, and meaning the same kernel (dispatching runs no kernel)
    assert which_backend(x, channel_dim=channel_dim, spatial=spatial, backend=name) == name


def test_the_torch_backend_can_be_requested() -> None:
    x = torch.randn(3, 8, dtype=torch.float64)
    assert which_backend(x) == "torch"
    torch.testing.assert_close(mrs_norm(x, backend="torch"), mrs_norm(x, backend="eager"))


def test_eager_and_empty_inputs_run_the_reference_formula() -> None:
    assert which_backend(torch.randn(4, 8), backend="eager") == "eager"
    assert which_backend(torch.randn(0, 8)) == "eager"


def _count_cpp_checks(monkeypatch: pytest.MonkeyPatch) -> list[DispatchKey]:
    seen: list[DispatchKey] = []
    real = dispatch._cpp_unavailable

    def counting(key: DispatchKey) -> Optional[str]:
        seen.append(key)
        return real(key)

    monkeypatch.setattr(dispatch, "_cpp_unavailable", counting)
    return seen


def test_the_route_is_made_once_per_kind_of_call(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _count_cpp_checks(monkeypatch)
    first = which_backend(torch.randn(6, 8))
    assert which_backend(torch.randn(6, 8)) == first  # the same kind of call: its cached route
    mrs_norm(torch.randn(6, 8))  # the op's default arguments: the same route again
    assert len(seen) == 1
    which_backend(torch.randn(7, 8))  # another shape: a new route (its own canonical view)
    which_backend(torch.randn(6, 8, dtype=torch.bfloat16))  # another dtype: a new route
    with contextlib.suppress(ValueError):  # refused where the C++ kernels cannot be built
        which_backend(torch.randn(6, 8), backend="cpp")  # another request: a new route
    assert len(seen) == 4
    dispatch.clear_cache()
    which_backend(torch.randn(6, 8))
    assert len(seen) == 5  # forgotten: asked again


def test_one_cache_holds_every_route() -> None:
    # the operator pair's routes and every other live in dispatch.ROUTES, nowhere else
    x = torch.randn(4, 8)
    routes = [dispatch.route_for(x, None, 1e-6, -1, False, "auto"),
              dispatch.route_for(x, None, 1e-6, -1, False, "torch"),
              dispatch.route_for(x, None, 1e-6, -1, False, "eager")]
    assert len(dispatch.ROUTES) == 3 and all(any(p is q for q in dispatch.ROUTES.values()) for p in routes)
    assert [p.kernel for p in routes] == [CPP or "torch", "torch", "eager"]
    assert [p.fallback for p in routes] == [None if CPP else "torch", "torch", None]
    dispatch.clear_cache()
    assert not dispatch.ROUTES


@pytest.mark.skipif(CPP is None, reason="the C++ kernels could not be built")
def test_environment_is_read_when_a_key_is_first_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = torch.randn(20, 8)
    assert which_backend(tokens) == "cpp"
    monkeypatch.setenv("LIGHTNING_MRS_CPU_KERNELS", "0")
    assert which_backend(tokens) == "cpp"  # this key's choice is cached
    assert which_backend(tokens.bfloat16()) == "inductor"  # a new key sees the switch (160 >= 64)
    monkeypatch.setenv("LIGHTNING_MRS_COMPILE_MIN_NUMEL", "1000")
    assert which_backend(tokens.half()) == "inductor"  # the threshold was read once: 64
    dispatch.clear_cache()
    assert which_backend(tokens) == "torch"  # both re-read: no C++, 160 < 1000
