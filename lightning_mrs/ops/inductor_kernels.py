"""The ``inductor`` backend: the plain-torch bodies of :mod:`.torch_kernels` compiled by Inductor
(C++/OpenMP on the CPU, Triton on a GPU) on first use, with symbolic sizes (``dynamic=True``;
``LIGHTNING_MRS_DYNAMIC=0`` specialises on widths and resolutions).

Failures are never swallowed whole: ``auto`` does not pick this backend where it cannot compile
(:func:`unavailable` says why); a toolchain failure while compiling (Inductor's
``InvalidCxxCompiler``, ``CppCompileError``, ``CUDACompileError``) gives one ``RuntimeWarning`` and
the bodies run eagerly for the rest of the process; a body past Dynamo's variant limit runs its new
variants eagerly (one warning); out of memory and any other failure is raised, with the way out
(``backend="torch"``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import threading
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_mrs.ops import cpp_build, torch_kernels
from lightning_mrs.ops.layout import DispatchKey, Layout

__all__ = ["backward", "compile_failed", "forward", "unavailable"]

_COMPILE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_COMPILED: dict[str, Callable] = {}  # one compiled function per body, for the process
_LOCK = threading.Lock()
_FAILED: list[str] = []  # the first compile error, if any (then everything runs eagerly)
_RECOMPILE_LIMIT = 64  # compiled variants per body (dtype x memory layout; sizes are dynamic)
_LIMITED: set[str] = set()  # bodies that reached the limit (warned once each)
_TOOLCHAIN_ERRORS = ("InvalidCxxCompiler", "CppCompileError", "CUDACompileError")
# torch.compile's own per-function limit is newer than some torch releases the package installs on
_HAS_RECOMPILE_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


def _dynamic() -> bool:
    return os.environ.get("LIGHTNING_MRS_DYNAMIC", "1") != "0"


def compile_failed() -> Optional[str]:
    """The error that disabled the compiled path in this process, or ``None``."""
    return _FAILED[0] if _FAILED else None


@functools.cache
def _toolchain(device_type: str) -> Optional[str]:
    """Why Inductor cannot compile for ``device_type`` on this machine, or ``None``."""
    if device_type == "cuda":
        return None if importlib.util.find_spec("triton") else "Triton is not installed (pip install triton)"
    return None if cpp_build.compiler() else "no C++ compiler found (install g++ or set CXX)"


def _toolchain_error(err: BaseException) -> Optional[BaseException]:
    """The compiler failure inside ``err`` (Dynamo wraps it in ``BackendCompilerFailed``), or ``None``."""
    seen: set[int] = set()
    todo: list[Optional[BaseException]] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if type(e).__name__ in _TOOLCHAIN_ERRORS:
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return None


def _disable(err: BaseException) -> None:
    if not _FAILED:
        _FAILED.append(f"{type(err).__name__}: {err}")
        warnings.warn(
            "lightning_mrs: the C++/GPU compiler failed while compiling the fused MRSNorm kernels, so their "
            f"plain torch bodies run eagerly for the rest of this process (same results, slower): {_FAILED[0][:300]}. "
            "Fix or install the compiler (g++; CXX=...), or pass backend='torch' to avoid compiling altogether.",
            RuntimeWarning,
            stacklevel=4,
        )


def _compiled(name: str) -> Callable:
    fn = _COMPILED.get(name)
    if fn is None:
        with _LOCK:
            fn = _COMPILED.get(name)
            if fn is None:
                body = torch_kernels.BODIES[name]
                limit = {"recompile_limit": _RECOMPILE_LIMIT} if _HAS_RECOMPILE_LIMIT else {}
                fn = torch.compile(body, fullgraph=True, dynamic=_dynamic(), **limit)
                _COMPILED[name] = fn
    return fn


def _run(name: str, *args: object) -> tuple[Tensor, Optional[Tensor]]:
    """Body ``name`` compiled (the first call compiles); eagerly once compiling has failed."""
    if _FAILED:
        return torch_kernels.BODIES[name](*args)
    fn = _compiled(name)
    if not _dynamic():
        for t in args:  # the batch dim stays dynamic
            if isinstance(t, Tensor) and t.ndim == 3 and t.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)
    try:
        return fn(*args)
    except (torch.OutOfMemoryError, MemoryError):
        raise  # never a reason to change path: the eager body needs as much memory
    except Exception as err:
        out = torch_kernels.BODIES[name](*args)  # a genuine input error re-raises here, untouched
        if type(err).__name__ == "FailOnRecompileLimitHit":  # this body, new variants only
            _warn_limit(name)
        elif (toolchain := _toolchain_error(err)) is not None:
            _disable(toolchain)
        else:
            raise RuntimeError(
                f"lightning_mrs: the compiled MRSNorm body {name!r} (backend 'inductor') failed: "
                f"{type(err).__name__}: {str(err)[:300]}. Its plain torch body runs this input fine: pass "
                "backend='torch' (or set norm.backend = 'torch') to avoid compiling, and please report the error."
            ) from err
        return out


def _warn_limit(name: str) -> None:
    if name not in _LIMITED:
        _LIMITED.add(name)
        warnings.warn(
            f"lightning_mrs: the compiled MRSNorm body {name!r} reached Dynamo's limit of {_RECOMPILE_LIMIT} "
            "variants (dtypes and memory layouts); new variants run its plain torch body eagerly (same results, "
            "slower), the compiled ones stay in use.",
            RuntimeWarning,
            stacklevel=4,
        )


# --- the backend interface (what lightning_mrs.ops.dispatch asks of a backend module) ---------
def unavailable(key: DispatchKey, explicit: bool) -> Optional[str]:
    """Why ``auto`` should not compile for ``key`` (an explicit request only needs a device
    Inductor compiles for)."""
    if key.device_type not in ("cpu", "cuda"):
        return f"Inductor does not compile for {key.device_type} tensors"
    if (missing := _toolchain(key.device_type)) is not None:
        return missing
    if explicit:
        return None
    if key.dtype not in _COMPILE_DTYPES:
        return f"{key.dtype} is left to the eager bodies"
    if not key.large:
        return "too small to be worth a compile"
    if _FAILED:
        return f"compiling failed earlier in this process ({_FAILED[0][:200]})"
    return None


def forward(x3: Tensor, w: Optional[Tensor], eps: float, layout: Layout) -> tuple[Tensor, Tensor]:
    """``(y3, r_sum)`` of the compiled forward body."""
    return torch_kernels.forward(x3, w, eps, layout, run=_run)


def backward(x3: Tensor, w: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float,
             layout: Layout) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx3, dw)`` of the compiled backward body."""
    return torch_kernels.backward(x3, w, r_sum, g3, eps, layout, run=_run)
