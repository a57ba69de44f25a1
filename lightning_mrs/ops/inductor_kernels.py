"""The ``inductor`` backend: the plain-torch bodies of :mod:`lightning_mrs.ops.torch_kernels`
compiled by Inductor (C++/OpenMP on the CPU, Triton on a GPU) on first use.

All sizes are symbolic (``dynamic=True``): new batch sizes, widths and resolutions reuse the
compiled code (sizes 0/1 and ``A*L % 8`` in the backward are the only specialisations);
``LIGHTNING_MRS_DYNAMIC=0`` specialises on the widths and resolutions (the batch stays
dynamic). If compiling fails (no C++ compiler, an unsupported platform), one
``RuntimeWarning`` is raised and the bodies run eagerly for the rest of the process.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Optional

import torch
from torch import Tensor

from lightning_mrs.ops import torch_kernels
from lightning_mrs.ops.layout import DispatchKey, Layout

__all__ = ["NAME", "backward", "compile_failed", "forward", "unavailable"]

NAME = "inductor"
_COMPILE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_COMPILED: dict[str, Callable] = {}  # one compiled function per body, for the process
_LOCK = threading.Lock()
_FAILED: list[str] = []  # the first compile error, if any (then everything runs eagerly)
_RECOMPILE_LIMIT = 64  # compiled variants per body (dtype x memory layout; sizes are dynamic)
_LIMITED: set[str] = set()  # bodies that reached the limit (warned once each)


def _dynamic() -> bool:
    return os.environ.get("LIGHTNING_MRS_DYNAMIC", "1") != "0"


def compile_failed() -> Optional[str]:
    """The error that disabled the compiled path in this process, or ``None``."""
    return _FAILED[0] if _FAILED else None


def _disable(err: BaseException) -> None:
    if not _FAILED:
        _FAILED.append(f"{type(err).__name__}: {err}")
        warnings.warn(
            "lightning_mrs: compiling the fused MRSNorm kernels failed, so their plain torch bodies run "
            f"eagerly for the rest of this process (same results, slower): {_FAILED[0][:300]}. If the error "
            "is about a C++ compiler, install one (g++); backend='eager' avoids compiling altogether.",
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
                fn = torch.compile(body, fullgraph=True, dynamic=_dynamic(), recompile_limit=_RECOMPILE_LIMIT)
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
    except Exception as err:  # no C++ compiler, unsupported platform, Inductor bug
        out = torch_kernels.BODIES[name](*args)  # a genuine input error re-raises here, untouched
        if type(err).__name__ == "FailOnRecompileLimitHit":  # this body, new variants only
            _warn_limit(name)
        else:
            _disable(err)
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


# --- the backend interface (see lightning_mrs.ops.dispatch.Backend) -------------------------
def unavailable(key: DispatchKey, explicit: bool) -> Optional[str]:
    """Why ``auto`` should not compile for ``key`` (an explicit request only needs a device
    Inductor compiles for)."""
    if key.device_type not in ("cpu", "cuda"):
        return f"Inductor does not compile for {key.device_type} tensors"
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
    return torch_kernels.call_forward(x3, w, eps, layout, run=_run)


def backward(x3: Tensor, w: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float,
             layout: Layout) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx3, dw)`` of the compiled backward body."""
    return torch_kernels.call_backward(x3, w, r_sum, g3, eps, layout, run=_run)
