"""Every public entry x every backend x every memory layout x every dtype, against the float64
reference (PyTorch's OpInfo idea: each op on non-contiguous samples too).

Entries: ``mrs_norm`` with the channels last, first and in a middle dim, one ``S`` per
position or per sample; ``MRSNorm``; ``MRSNorm2d`` per position and per sample. Backends:
``eager``, ``auto``, and ``torch`` (functional entries: it is internal), ``inductor`` and
``cpp`` forced; a forced backend that cannot run a case must raise a ``ValueError`` that
says why. Layouts: see :data:`LAYOUTS`. Forward, input gradient and weight gradient are
compared, with and without a weight.

Compiling costs seconds per (kernel shape, dtype, weight), so the default run compiles
Inductor for float32 with a weight only; the full Inductor product is marked slow.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable, Optional

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_mrs import MRSNorm, MRSNorm2d
from lightning_mrs.ops import inductor_kernels
from lightning_mrs.ops.dispatch import route_for
from lightning_mrs.ops.layout import Canonical
from helpers.checks import CPP_BUILT, Grads, assert_matches_reference, forced, grads, is_dense

CHANNELS = 10  # 5 phasors

# name -> (channel_dim, spatial, module class or None)
ENTRIES: dict[str, tuple[int, bool, Optional[type[nn.Module]]]] = {
    "last": (-1, False, None),
    "last_per_sample": (-1, True, None),
    "first": (1, False, None),
    "first_per_sample": (1, True, None),
    "middle": (2, False, None),
    "middle_per_sample": (2, True, None),
    "MRSNorm": (-1, False, MRSNorm),
    "MRSNorm2d": (1, False, MRSNorm2d),
    "MRSNorm2d_per_sample": (1, True, MRSNorm2d),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}

Random = Callable[[tuple[int, ...]], Tensor]  # shape -> a contiguous random tensor in the test's dtype


def _in_order(values: Tensor, order: list[int]) -> Tensor:
    """``values`` stored with its dims in ``order`` (outermost first), seen in its own order."""
    return values.permute(order).contiguous().permute([order.index(d) for d in range(values.ndim)])


def _others(shape: tuple[int, ...], channel_dim: int) -> list[int]:
    return [d for d in range(len(shape)) if d != channel_dim]


def _slice_last_other(shape: tuple[int, ...], channel_dim: int, rand: Random) -> Tensor:
    dim = _others(shape, channel_dim)[-1]
    big = rand(shape[:dim] + (2 * shape[dim],) + shape[dim + 1:])
    return big[(slice(None),) * dim + (slice(1, None, 2),)]  # every other row: strided, not dense


def _expanded_batch(shape: tuple[int, ...], channel_dim: int, rand: Random) -> Tensor:
    return rand((1,) + shape[1:]).expand(shape)  # batch stride 0


# name -> (the logical shape's non-channel sizes, builder(shape, channel_dim, rand))
LAYOUTS: dict[str, tuple[tuple[int, int, int], Callable[[tuple[int, ...], int, Random], Tensor]]] = {
    "contiguous": ((3, 4, 5), lambda s, d, rand: rand(s)),
    "channels_last": ((3, 4, 5), lambda s, d, rand: rand(s).contiguous(memory_format=torch.channels_last)),
    "permuted_channels_last": ((3, 4, 5), lambda s, d, rand: _in_order(rand(s), _others(s, d) + [d])),
    "permuted_channels_first": ((3, 4, 5), lambda s, d, rand: _in_order(rand(s), [0, d] + _others(s, d)[1:])),
    "strided_slice": ((3, 4, 5), _slice_last_other),
    "expanded_batch": ((3, 4, 5), _expanded_batch),
    "transposed_pair": ((3, 4, 5), lambda s, d, rand: rand(s[:-2] + s[:-3:-1]).transpose(-1, -2)),
    "size_one_dims": ((1, 1, 3), lambda s, d, rand: rand(s)),
    "empty_batch": ((0, 4, 5), lambda s, d, rand: rand(s)),
}
#: The layouts that are a permutation of a contiguous tensor (no gaps, no overlaps).
DENSE_LAYOUTS = ["contiguous", "channels_last", "permuted_channels_last", "permuted_channels_first", "transposed_pair"]


def make_case(entry: str, layout: str, dtype: torch.dtype, affine: bool) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """``(x, w, gy)``: ``x`` of the entry's logical shape in ``layout``, drawn in float64."""
    channel_dim = ENTRIES[entry][0] % 4
    sizes, build = LAYOUTS[layout]
    shape = sizes[:channel_dim] + (CHANNELS,) + sizes[channel_dim:]
    g = torch.Generator().manual_seed(0)

    def rand(s: tuple[int, ...]) -> Tensor:
        return (3 * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype)

    x = build(shape, channel_dim, rand)
    assert x.shape == shape
    w = (torch.rand(CHANNELS // 2, generator=g, dtype=torch.float64) + 0.5).to(dtype) if affine else None
    gy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, w, gy


def norm_under_test(entry: str, backend: str) -> Callable[[Tensor, Optional[Tensor]], Tensor]:
    """``(x, w) -> y`` through the entry with ``backend``; a module takes ``w`` as its weight."""
    channel_dim, spatial, module_class = ENTRIES[entry]
    if module_class is None:
        return forced(backend, channel_dim, spatial)

    def run_module(x: Tensor, w: Optional[Tensor]) -> Tensor:
        kwargs = {"spatial": spatial} if module_class is MRSNorm2d else {}
        norm = module_class(CHANNELS, affine=w is not None, device="meta", **kwargs)
        norm.backend = backend
        return functional_call(norm, {"weight": w} if w is not None else {}, (x,))

    return run_module


def cpp_runs(x: Tensor, channel_dim: int, spatial: bool) -> bool:
    """The C++ kernels' contract: float32/bfloat16/float16 in a dense tensor with the channels
    innermost (rows; per sample only with the batch dim outermost), or one S per sample with
    the batch dim outermost and the channels next (NCHW-like); empty inputs run the reference
    formula whatever the request."""
    if x.numel() == 0:
        return True
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not is_dense(x):
        return False
    in_memory = sorted((d for d in range(x.ndim) if x.shape[d] > 1), key=lambda d: -x.stride(d))
    batch_outermost = x.shape[0] == 1 or in_memory[0] == 0
    if x.stride(channel_dim) == 1:
        return batch_outermost or not spatial
    after_batch = [d for d in in_memory if d != 0]
    return spatial and batch_outermost and after_batch[0] == channel_dim


def _case(entry: str, backend: str, layout: str, dtype_name: str, affine: bool, slow: bool = False) -> Any:
    marks = [pytest.mark.slow] if slow else []
    if backend == "cpp" and not CPP_BUILT:
        marks.append(pytest.mark.skip(reason="the C++ kernels could not be built"))
    case_id = f"{entry}-{backend}-{layout}-{dtype_name}-{'weight' if affine else 'no_weight'}"
    return pytest.param(entry, backend, layout, dtype_name, affine, marks=marks, id=case_id)


def _cases() -> list:
    cases = []
    for entry, (_, _, module_class) in ENTRIES.items():
        for backend in ("eager", "auto", "torch", "cpp"):
            if backend == "torch" and module_class is not None:
                continue  # not a value of the modules' backend attribute
            cases += [_case(entry, backend, layout, dtype_name, affine)
                      for layout in LAYOUTS for dtype_name in DTYPES for affine in (True, False)]
    # Inductor compiles per (kernel shape, dtype, weight, strides of the views, size-1 dims):
    # float32 with a weight on the dense layouts in the default run (the graphs of
    # test_backends.py); the rest is slow, grouped by dtype (see fresh_inductor_per_dtype)
    for dtype_name in DTYPES:
        for affine in (True, False):
            for entry in ENTRIES:
                for layout in LAYOUTS:
                    slow = not (dtype_name == "f32" and affine and layout in DENSE_LAYOUTS)
                    cases.append(_case(entry, "inductor", layout, dtype_name, affine, slow))
    return cases


_INDUCTOR_DTYPE: list[str] = []  # the dtype whose variants Dynamo holds now


@pytest.fixture
def fresh_inductor_per_dtype(backend: str, dtype_name: str) -> Iterator[None]:
    """For the Inductor cases: start each dtype group with empty Dynamo caches. Dynamo allows
    64 compiled variants per kernel body; the whole product holds more, and past the limit the
    backend would fall back to the eager bodies and this matrix would not test Inductor."""
    if backend == "inductor" and _INDUCTOR_DTYPE[-1:] != [dtype_name]:
        if _INDUCTOR_DTYPE:  # the first group keeps what other tests compiled
            torch._dynamo.reset()
            inductor_kernels._COMPILED.clear()
        _INDUCTOR_DTYPE.append(dtype_name)
    yield
    if backend == "inductor":  # still compiled, not fallen back to the eager bodies at the limit
        assert "RecompileLimit" not in (inductor_kernels.compile_failed() or "")


@pytest.mark.usefixtures("fresh_inductor_per_dtype")
@pytest.mark.parametrize("entry,backend,layout,dtype_name,affine", _cases())
def test_entry_backend_layout_dtype(entry: str, backend: str, layout: str, dtype_name: str, affine: bool) -> None:
    channel_dim, spatial, _ = ENTRIES[entry]
    x, w, gy = make_case(entry, layout, DTYPES[dtype_name], affine)
    norm = norm_under_test(entry, backend)
    if backend == "cpp" and not cpp_runs(x, channel_dim % x.ndim, spatial):
        with pytest.raises(ValueError, match=r"backend='cpp'\) cannot run .*: .+\. Use backend='auto'"):
            norm(x, w)
        return
    got: Grads = grads(norm, x, w, gy)
    assert_matches_reference(got, x, w, gy, channel_dim, spatial)


# --- regression: a channels-first view normalised with channel_dim=-1, spatial=True -----------
# The old canonical view reshaped such an input to (A, C, L) without moving the channel dim
# first, so each "channel" mixed positions and channels: the result differed from the same
# values stored contiguously.
REPRODUCTIONS = {
    "nchw_permuted_to_nhwc": lambda: torch.randn(2, 8, 4, 4).permute(0, 2, 3, 1),
    "ncl_transposed": lambda: torch.randn(2, 8, 5).transpose(1, 2),
}


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("reproduction", list(REPRODUCTIONS))
def test_channels_first_view_with_channel_dim_last_per_sample(reproduction: str, backend: str) -> None:
    x = REPRODUCTIONS[reproduction]()
    assert x.stride(-1) != 1  # the channels are not the innermost dim of this view
    w = torch.rand(4) + 0.5
    norm = forced(backend, -1, True)
    y = norm(x, w)
    torch.testing.assert_close(y, norm(x.contiguous(), w), atol=1e-6, rtol=1e-6)
    gy = torch.randn(x.shape)
    assert_matches_reference(grads(norm, x, w, gy), x, w, gy, -1, True)


# --- dense layouts are viewed, not copied ------------------------------------------------------


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
@pytest.mark.parametrize("entry", [name for name, (_, _, module_class) in ENTRIES.items() if module_class is None])
def test_dense_layouts_are_viewed_without_a_copy(entry: str, layout: str) -> None:
    # one S per position: any dense layout is a view; one S per sample: unless the channels
    # sit between other dims in memory (then the output is copied back to x's layout)
    channel_dim, spatial, _ = ENTRIES[entry]
    x, _, _ = make_case(entry, layout, torch.float32, affine=False)
    canonical = Canonical.of(x, channel_dim % x.ndim, spatial)
    expected = not spatial or cpp_runs(x, channel_dim % x.ndim, spatial)
    assert canonical.dense == expected
    assert canonical.relayout == (not expected)  # a copied view of a dense input: results go back
    if expected:
        assert canonical.view(x).data_ptr() == x.data_ptr()  # the same memory


def test_the_view_is_cached_per_shape_strides_and_mode() -> None:
    # the canonical view is part of the call's route, cached on what decides it
    x = torch.randn(2, 8, 3, 3)
    first = route_for(x, None, 1e-6, 1, True, "torch")
    assert route_for(torch.randn(2, 8, 3, 3), None, 1e-6, 1, True, "torch") is first  # same shape, strides, mode
    other = route_for(x.contiguous(memory_format=torch.channels_last), None, 1e-6, 1, True, "torch")
    assert other.canonical.layout.last and not first.canonical.layout.last  # the strides are part of the key
    assert route_for(x, None, 1e-6, 1, False, "torch").canonical != first.canonical  # so is the mode
