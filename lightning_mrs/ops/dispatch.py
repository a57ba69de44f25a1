"""The backends of the fused MRSNorm: one interface, one table, one cached choice.

Every backend is a module that implements :class:`Backend`: a ``forward`` and a
``backward`` on the canonical 3-d views of :mod:`lightning_mrs.ops.layout`, and
``unavailable(key, explicit)``, which says why it cannot run a :class:`DispatchKey`
(``None`` when it can). :data:`KERNELS` lists them in the order ``backend="auto"`` tries
them; :data:`BACKENDS` is every value the op's ``backend=`` takes (``auto``, ``eager``: the
reference formula, and these names):

========== ====================================================== ===============================
name       what                                                   ``auto`` picks it for
========== ====================================================== ===============================
triton     hand-written Triton kernels (:mod:`.triton_kernels`)    CUDA, one ``S`` per position
cpp        hand-written one-pass C++/OpenMP (:mod:`.cpu_kernels`)  CPU float32/bf16/fp16, channels
                                                                  contiguous, or NCHW per sample
inductor   the torch bodies compiled (:mod:`.inductor_kernels`)   the rest, >= 2^18 elements
torch      the torch bodies run eagerly (:mod:`.torch_kernels`)   the rest (float64, small, meta)
========== ====================================================== ===============================

The choice depends only on the :class:`DispatchKey` (device type, dtype, layout, whether the
view is dense, whether the tensor is large) and on the request, so it is made once per key
and cached (:func:`resolve_rows` caches the common case, a dense channels-last CPU input,
on its dtype and size alone); the environment variables (``LIGHTNING_MRS_CPU_KERNELS``,
``LIGHTNING_MRS_COMPILE_MIN_NUMEL``, ``TRITON_INTERPRET``) are read when a key is first seen.
:func:`clear_cache` forgets every choice (tests, or after changing those variables).
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Optional, Protocol

from torch import Tensor

from lightning_mrs.ops.layout import DispatchKey, Layout

__all__ = [
    "BACKENDS", "Backend", "KERNELS", "clear_cache", "compile_min_numel", "get_backend", "resolve", "resolve_rows",
]

#: Kernel backend name -> module, in the order ``backend="auto"`` tries them.
KERNELS: dict[str, str] = {
    "triton": "lightning_mrs.ops.triton_kernels",
    "cpp": "lightning_mrs.ops.cpu_kernels",
    "inductor": "lightning_mrs.ops.inductor_kernels",
    "torch": "lightning_mrs.ops.torch_kernels",
}
#: The values of the op's ``backend=``: ``auto`` (the default) picks the fastest available
#: kernel, ``eager`` runs the reference formula, a name of :data:`KERNELS` forces that kernel
#: (benchmarks, bug reports). Every answer of ``which_backend`` is one of them.
BACKENDS: tuple[str, ...] = ("auto", "eager", *KERNELS)
_ROWS = Layout(last=True, spatial=False)  # tokens: channels contiguous, one S per row
_DEFAULT_COMPILE_MIN_NUMEL = 1 << 18  # 1 MiB of fp32: below, a compile is not worth its seconds


class Backend(Protocol):
    """What every backend module implements (``x3``: a canonical view, ``w``: the per-phasor
    gain ``(P,)`` in its own dtype or ``None``, ``r_sum``: ``P * S`` per group as the forward
    returned it; the backward's ``dw`` is ``(P,)``, in float32 or the compute dtype)."""

    NAME: str

    def unavailable(self, key: DispatchKey, explicit: bool) -> Optional[str]: ...

    def forward(self, x3: Tensor, w: Optional[Tensor], eps: float, layout: Layout) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, x3: Tensor, w: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float, layout: Layout
    ) -> tuple[Tensor, Optional[Tensor]]: ...


_CACHE: dict[tuple[DispatchKey, str], str] = {}
_ROWS_CACHE: dict[tuple[object, bool], str] = {}  # (dtype, large) -> auto's choice for dense CPU rows
_LOCK = threading.Lock()
_SETTINGS: dict[str, int] = {}


def get_backend(name: str) -> Backend:
    """The backend module called ``name`` (imported on first use: triton is heavy)."""
    return importlib.import_module(KERNELS[name])  # type: ignore[return-value]


def compile_min_numel() -> int:
    """Elements from which ``auto`` compiles (``LIGHTNING_MRS_COMPILE_MIN_NUMEL``, read once)."""
    if "min_numel" not in _SETTINGS:
        _SETTINGS["min_numel"] = int(os.environ.get("LIGHTNING_MRS_COMPILE_MIN_NUMEL", _DEFAULT_COMPILE_MIN_NUMEL))
    return _SETTINGS["min_numel"]


def clear_cache() -> None:
    """Forget every cached choice and re-read the environment variables on the next call."""
    with _LOCK:
        _CACHE.clear()
        _ROWS_CACHE.clear()
        _SETTINGS.clear()


def _choose(key: DispatchKey, request: str) -> str:
    if request != "auto":
        reason = get_backend(request).unavailable(key, explicit=True)
        if reason is not None:
            raise ValueError(
                f"mrs_norm(backend={request!r}) cannot run a {key.device_type} {key.dtype} input with "
                f"{'the channels' if key.layout.last else 'the positions'} innermost and "
                f"spatial={key.layout.spatial}: {reason}. Use backend='auto' to pick the best available kernel."
            )
        return request
    for name in KERNELS:
        if get_backend(name).unavailable(key, explicit=False) is None:
            return name
    raise AssertionError("the torch backend runs everywhere")  # pragma: no cover


def resolve(key: DispatchKey, request: str = "auto") -> str:
    """The backend that ``request`` (``"auto"`` or a name of :data:`KERNELS`) means for ``key``.

    Raises:
        ValueError: an explicit request that cannot run ``key``, with the reason.
    """
    choice = _CACHE.get((key, request))
    if choice is None:
        with _LOCK:
            choice = _CACHE.get((key, request))
            if choice is None:
                choice = _choose(key, request)  # may build the C++ kernels (once per process)
                _CACHE[(key, request)] = choice
    return choice


def resolve_rows(dtype: object, large: bool) -> str:
    """``resolve(key)`` for ``auto`` and a dense, channels-last CPU input with one ``S`` per
    row (tokens: the common case), cached on ``(dtype, large)`` alone so that the op's fast
    path builds no :class:`DispatchKey` per call."""
    choice = _ROWS_CACHE.get((dtype, large))
    if choice is None:
        choice = resolve(DispatchKey("cpu", dtype, _ROWS, True, large))  # type: ignore[arg-type]
        _ROWS_CACHE[(dtype, large)] = choice
    return choice
