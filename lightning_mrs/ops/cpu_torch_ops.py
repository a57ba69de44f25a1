"""The C++ row kernels as torch operators (``cpu_torch_ops.cpp``): the compiled graphs' fast path.

A compiled graph that normalises contiguous channels-last CPU tokens - the call an eager
``mrs_norm`` runs as :class:`~lightning_mrs.ops.plan.RowsPlan` - calls
``torch.ops.lightning_mrs.rows_forward(x, weight, eps) -> (y, r_sum)`` and
``rows_backward(grad, x, weight, r_sum, eps, need_weight_grad) -> (dx, dw)``, whose CPU kernels
are C++: they check the call, allocate the outputs and run the row kernels of
:mod:`.cpu_kernels` with no Python on the way (:mod:`.library` chooses them when tracing). The
fake kernels below give their outputs' metadata to AOTAutograd and Inductor.

The operators hold only the addresses of the row kernels of the kernel set in use:
:func:`sync` sets them, and :mod:`.cpu_kernels` calls it whenever that set changes (its first
build, :func:`~lightning_mrs.ops.cpu_kernels.using`), so a compiled graph runs the same kernels
as an eager call at that moment.

The library is compiled on first use (:func:`load`, from ``torch.compile``'s tracing) against
torch's own headers and libraries (C++20, as torch itself), into the cache folder of
:mod:`.cpu_kernels`, keyed by the source, torch's version and the compiler; it takes a few
seconds. Where it cannot be built (no compiler, no headers) or ``LIGHTNING_MRS_CPU_TORCH_OPS=0``,
:func:`load` returns ``False``, :func:`build_error` says why, and compiled graphs call the
general ops (:mod:`.library`), whose Python bodies run the same kernels.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from lightning_mrs.ops import cpp_build, cpu_kernels

__all__ = ["build_error", "load", "sync"]

SOURCE = Path(__file__).with_suffix(".cpp")  # cpu_torch_ops.cpp, beside this file
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the order of the C++ tables
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "lib" (ctypes.CDLL or None), "error"


def _flags() -> list[str]:
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}"]


def _build() -> ctypes.CDLL:
    cxx = cpp_build.compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    contents = [SOURCE.read_bytes(), torch.__version__.encode()]
    target, error = cpp_build.compile_cached("mrs_norm_torch_ops", cxx, _flags(), SOURCE, contents,
                                             libs=("-ltorch_cpu", "-lc10"))
    if error is not None:
        errors = [ln for ln in error.splitlines() if "error" in ln] or error.splitlines()
        raise RuntimeError(f"compiling {SOURCE.name} with {cxx} failed: {' | '.join(errors[:3])[-600:]}")
    torch.ops.load_library(str(target))  # registers lightning_mrs::rows_forward and rows_backward
    lib = ctypes.CDLL(str(target))  # the same handle: for mrs_set_row_kernels
    lib.mrs_set_row_kernels.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.c_int64]
    lib.mrs_set_row_kernels.restype = None
    _register_fakes()
    return lib


def _register_fakes() -> None:
    lib = torch.library.Library("lightning_mrs", "FRAGMENT")  # noqa: TOR901 - kept for the process's life
    _STATE["fakes"] = lib

    def forward_fake(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
        return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)

    def backward_fake(grad: Tensor, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, eps: float,
                      need_weight_grad: bool) -> tuple[Tensor, Tensor]:
        dw = torch.empty_like(weight) if need_weight_grad and weight is not None else x.new_empty(0)
        return torch.empty_like(x), dw

    torch.library.register_fake("lightning_mrs::rows_forward", forward_fake, lib=lib)
    torch.library.register_fake("lightning_mrs::rows_backward", backward_fake, lib=lib)


def load() -> bool:
    """Whether ``torch.ops.lightning_mrs.rows_forward`` and ``rows_backward`` can run here
    (builds and loads them on the first call, and gives them the kernels in use)."""
    if os.environ.get("LIGHTNING_MRS_CPU_TORCH_OPS", "1") == "0" or not cpu_kernels.available():
        return False
    if "lib" not in _STATE:
        with _LOCK:
            if "lib" not in _STATE:
                try:
                    _STATE["lib"] = _build()
                except Exception as err:  # no compiler, no torch headers, an unwritable cache...
                    _STATE["lib"] = None
                    _STATE["error"] = f"{type(err).__name__}: {err}"
                    warnings.warn(
                        "lightning_mrs: building the compiled graphs' C++ operators failed; compiled "
                        "graphs call the row kernels through Python instead, with the same results "
                        f"({_STATE['error'][:400]}). Set LIGHTNING_MRS_CPU_TORCH_OPS=0 to skip the build.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                else:
                    sync()
    return _STATE["lib"] is not None


def sync() -> None:
    """Give the operators the row kernels of the kernel set in use (a no-op before :func:`load`)."""
    lib = _STATE.get("lib")
    if lib is None or not cpu_kernels.available():
        return
    fwd = (ctypes.c_void_p * 3)(*(ctypes.cast(cpu_kernels._fn("fwd_rows", d), ctypes.c_void_p).value for d in _DTYPES))
    bwd = (ctypes.c_void_p * 3)(*(ctypes.cast(cpu_kernels._fn("bwd_rows", d), ctypes.c_void_p).value for d in _DTYPES))
    lib.mrs_set_row_kernels(fwd, bwd, cpu_kernels.MIN_NUMEL_PER_THREAD)  # type: ignore[attr-defined]


def build_error() -> Optional[str]:
    """Why the operators could not be built, or ``None``."""
    return _STATE.get("error")  # type: ignore[return-value]
