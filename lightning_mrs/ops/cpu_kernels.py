"""The ``cpp`` backend: hand-written one-pass CPU kernels (``cpu_kernels.cpp``), built on first use.

Two layouts have a kernel here, the two where Inductor's code falls short of torch's native
norms (see the source's header for why):

* ``rows``: ``(G, L, C)`` with the channels contiguous and one ``S`` per group of ``L`` rows
  (tokens and NHWC / ``channels_last`` per position with ``L = 1`` - the peer of
  ``nn.LayerNorm``; NHWC per sample with ``L`` = positions);
* ``sample``: ``(A, C, L)`` with the positions contiguous and one ``S`` per sample (NCHW
  per sample) - the peer of ``nn.GroupNorm(1, C)``.

The library is compiled once per machine with the system C++ compiler (``$CXX``, else
``c++``/``g++``/``clang++``; OpenMP, ``-O3 -march=native``) into a cache folder
(``$LIGHTNING_MRS_CACHE``, else ``~/.cache/lightning_mrs``), keyed by the source, the
compiler and the CPU's instruction sets, and loaded with :mod:`ctypes`
(``LIGHTNING_MRS_CPU_NATIVE=0``: without ``-march=native``, the portable build). Which kernels
the build holds is its *kernel set* (``LIGHTNING_MRS_CPU_KERNEL_SET``, or :func:`using` for a
block of code; :data:`KERNEL_SETS`): ``auto`` (the default) runs the AVX2 kernels of
``cpu_avx2.h`` where ``-march=native`` targets AVX2 without AVX-512, on AVX-512 those kernels
for float16 and the compiler-vectorised loops of ``cpu_kernels.cpp`` for float32 and bfloat16
(the faster of the two for each, as measured; with AVX512_BF16 the bfloat16 stores and the
output loops of the NCHW kernels are ``cpu_avx512.h``'s, one ``vcvtneps2bf16`` per 16 values,
and so are the row kernels of every dtype), and the loops everywhere else; ``avx2`` and
``generic`` ask for one of the two on any CPU that can run it. :func:`loaded_kernels` says which
kernels are running. Nothing happens at import time; :func:`available` triggers the build. If the build fails (no compiler, no OpenMP), :func:`available` returns ``False`` and
:func:`build_error` says why; ``backend="auto"`` then takes the next backend.
``LIGHTNING_MRS_CPU_KERNELS=0`` turns this path off.

The plain-torch bodies in :mod:`lightning_mrs.ops.torch_kernels` compute the same results;
the tests compare both against a float64 reference.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from lightning_mrs.ops import cpp_build
from lightning_mrs.ops.layout import DispatchKey, Layout

__all__ = ["KERNEL_SETS", "NAME", "available", "backward", "build_error", "build_flags", "forward", "kernel_set",
           "loaded_kernels", "unavailable", "using"]

NAME = "cpp"
SOURCE = Path(__file__).with_suffix(".cpp")  # cpu_kernels.cpp, beside this file
#: what SOURCE includes, directly or not: part of the cache key
HEADERS = tuple(SOURCE.with_name(h) for h in ("cpu_half.h", "cpu_rows.h", "cpu_sample.h", "cpu_avx2.h",
                                              "cpu_avx512.h"))
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_WKIND = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # the weight's dtype for the kernels
#: Elements per thread below which a call runs on one thread: waking an OpenMP team costs
#: microseconds, more than normalising a few thousand values.
MIN_NUMEL_PER_THREAD = 1 << 15
_LOCK = threading.Lock()
#: What ``LIGHTNING_MRS_CPU_KERNEL_SET`` (and :func:`using`) accept: ``auto`` (cpu_avx2.h's kernels
#: where ``-march=native`` targets AVX2, FMA and F16C without AVX-512, and on AVX-512 for float16
#: only; the generic loops for the rest, with cpu_avx512.h's bfloat16 stores and row kernels on
#: AVX512_BF16),
#: ``avx2`` (cpu_avx2.h's kernels for every dtype on any CPU with AVX2, FMA and F16C; always
#: ``-march=native``), ``generic`` (the compiler-vectorised loops of cpu_kernels.cpp everywhere).
KERNEL_SETS = ("auto", "avx2", "generic")
_DEFINES = {"auto": [], "avx2": ["-DMRS_KERNELS_AVX2"], "generic": ["-DMRS_KERNELS_GENERIC"]}
#: mrs_kernel_set() of the library -> the kernels it runs (loaded_kernels)
_LOADED = {1: "generic", 2: "avx2", 3: "avx2 for float16, generic for float32 and bfloat16",
           4: "avx512 rows; per sample avx2 for float16, avx512_bf16 for bfloat16, generic for float32"}
# The state of the kernel set in use: "set" (its name), "lib" (ctypes.CDLL or None), "error",
# "flags", "fns". One dict per set in _SETS; using() swaps _STATE, the hot path reads it as is.
_STATE: dict[str, object] = {}
_SETS: dict[str, dict[str, object]] = {}


def _checked(name: str, what: str) -> str:
    """``name`` if it is one of :data:`KERNEL_SETS`, else a ``ValueError`` that names ``what`` asked."""
    if name not in KERNEL_SETS:
        raise ValueError(f"{what} is not a CPU kernel set; choose one of {', '.join(KERNEL_SETS)} "
                         "(auto is the default)")
    return name


def _env_kernel_set() -> str:
    name = os.environ.get("LIGHTNING_MRS_CPU_KERNEL_SET", "auto") or "auto"
    return _checked(name, f"LIGHTNING_MRS_CPU_KERNEL_SET={name!r}")


def kernel_set() -> str:
    """The kernel set in use: :func:`using`'s inside its block, else ``LIGHTNING_MRS_CPU_KERNEL_SET``'s
    (``auto`` when unset)."""
    return _STATE.get("set") or _env_kernel_set()  # type: ignore[return-value]


@contextmanager
def using(name: str) -> Iterator[None]:
    """Run the C++ kernels of the kernel set ``name`` inside the block (built on first use, then
    cached like the default one). Plans need no clearing: every kernel call reads the set in use.
    The switch is process-wide while the block runs (other threads' calls take it too); it is
    meant for benchmarks and comparisons, ``LIGHTNING_MRS_CPU_KERNEL_SET`` for a whole run.

    Example::

        with cpu_kernels.using("generic"):
            y = mrs_norm(x)  # the compiler-vectorised loops, even on an AVX2 CPU

    Raises:
        ValueError: ``name`` is not one of :data:`KERNEL_SETS`.
        RuntimeError: that set cannot be built here (the message says why: no AVX2, no compiler...).
    """
    global _STATE
    before = _STATE
    _STATE = _SETS.setdefault(_checked(name, f"using({name!r})"), {"set": name})
    try:
        if _lib() is None:
            raise RuntimeError(f"the {name!r} CPU kernels could not be built here: {build_error()}")
        _publish()
        yield
    finally:
        _STATE = before
        _publish()


def _publish() -> None:
    """Hand the kernels in use to the compiled graphs' operators, once they are loaded
    (:mod:`.cpu_torch_ops`: they hold the kernels' addresses, not this module's state)."""
    ops = sys.modules.get("lightning_mrs.ops.cpu_torch_ops")
    if ops is not None:
        ops.sync()


def _flag_sets() -> list[list[str]]:
    """The compiler flags to try, in order, for the kernel set in use."""
    name = kernel_set()
    common = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-std=c++17", *_DEFINES[name]]
    native = os.environ.get("LIGHTNING_MRS_CPU_NATIVE", "1") != "0"
    if name == "avx2":
        # -march=native only: explicit -mavx2 flags would build, and then crash, on a CPU without AVX2
        if not native:
            raise RuntimeError("LIGHTNING_MRS_CPU_KERNEL_SET=avx2 builds with -march=native, which "
                               "LIGHTNING_MRS_CPU_NATIVE=0 turns off; unset one of the two")
        return [common + ["-march=native"]]
    if not native:  # the portable build only (x86-64 baseline)
        return [common]
    return [common + ["-march=native"], common]  # second try: a compiler without -march=native


def _build() -> ctypes.CDLL:
    cxx = cpp_build.compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    source = b"\0".join(f.read_bytes() for f in (SOURCE, *HEADERS))
    errors = []
    for flags in _flag_sets():
        target, error = cpp_build.compile_cached("mrs_norm_cpu", cxx, flags, SOURCE, [source, cpp_build.cpu_signature().encode()])
        if error is not None:
            errors.append(f"{' '.join(flags)}: {error.strip()[-400:]}")
            continue
        lib = ctypes.CDLL(str(target))
        _declare(lib)
        _STATE["flags"] = " ".join(flags)
        _STATE["kernels"] = _LOADED[lib.mrs_kernel_set()]
        return lib
    raise RuntimeError(f"compiling {SOURCE.name} with {cxx} failed: " + " | ".join(errors))


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for suffix in _SUFFIX.values():
        for kind in ("rows", "sample"):  # same signatures: (x[, g], w, wkind, ..., A, ., ., eps, nt)
            fwd = getattr(lib, f"mrs_fwd_{kind}_{suffix}")
            bwd = getattr(lib, f"mrs_bwd_{kind}_{suffix}")
            fwd.argtypes = [ptr, ptr, i32, ptr, ptr, i64, i64, i64, f32, i32]
            bwd.argtypes = [ptr, ptr, ptr, i32, ptr, ptr, ptr, i64, i64, i64, f32, i32]
            fwd.restype = bwd.restype = None
    lib.mrs_kernel_set.argtypes, lib.mrs_kernel_set.restype = [], ctypes.c_int


def _lib() -> Optional[ctypes.CDLL]:
    if "lib" not in _STATE:
        _STATE.setdefault("set", _env_kernel_set())  # a bad name raises here, at the first call, not as a warning
        with _LOCK:
            if "lib" not in _STATE:
                try:
                    _STATE["lib"] = _build()
                    _publish()
                except Exception as err:  # no compiler, no OpenMP, unwritable cache...
                    _STATE["lib"] = None
                    _STATE["error"] = f"{type(err).__name__}: {err}"
                    warnings.warn(
                        "lightning_mrs: building the one-pass CPU kernels failed, using the "
                        f"Inductor kernels instead ({_STATE['error'][:400]}). Install a C++ "
                        "compiler with OpenMP, or set LIGHTNING_MRS_CPU_KERNELS=0 to skip "
                        "the build.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
    return _STATE["lib"]  # type: ignore[return-value]


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels for ``dtype`` (float32, bfloat16, float16) can run here (builds the
    library on the first call)."""
    if os.environ.get("LIGHTNING_MRS_CPU_KERNELS", "1") == "0" or dtype not in _SUFFIX:
        return False
    lib = _lib()
    return lib is not None and hasattr(lib, f"mrs_fwd_rows_{_SUFFIX[dtype]}")


def build_error() -> Optional[str]:
    """Why the library could not be built, or ``None``."""
    return _STATE.get("error")  # type: ignore[return-value]


def loaded_kernels() -> Optional[str]:
    """Which kernels the loaded library runs: ``"avx2"`` (cpu_avx2.h), ``"generic"`` (the loops
    of cpu_kernels.cpp), or on an AVX-512 CPU under ``auto`` ``"avx2 for float16, generic for
    float32 and bfloat16"`` (with AVX512_BF16: ``"avx512 rows; per sample avx2 for float16,
    avx512_bf16 for bfloat16, generic for float32"``, the row kernels of cpu_avx512.h for every
    dtype); ``None`` before it is built or when it could not be."""
    return _STATE.get("kernels")  # type: ignore[return-value]


def build_flags() -> Optional[str]:
    """The compiler flags of the loaded library (``-march=native`` or the portable set), or
    ``None`` before it is built or when it could not be."""
    return _STATE.get("flags")  # type: ignore[return-value]


def unavailable(key: DispatchKey, explicit: bool) -> Optional[str]:
    """Why no kernel here covers ``key`` (``None`` when one does; builds the library on the
    first call that needs it). Covered: float32/bfloat16/float16 CPU tensors whose canonical
    view is contiguous, with the channels contiguous, or the positions contiguous and one ``S``
    per sample (``(A, C, L)`` per position stays with the other backends)."""
    if key.device_type != "cpu":
        return f"the C++ kernels run on the CPU, not on {key.device_type}"
    if key.dtype not in _SUFFIX:
        return f"they cover float32/bfloat16/float16, not {key.dtype}"
    if not key.dense:
        return "they need the channels contiguous, or the positions contiguous with spatial=True, in a dense tensor"
    if not (key.layout.last or key.layout.spatial):
        return "they need the channels contiguous, or the positions contiguous with spatial=True"
    if os.environ.get("LIGHTNING_MRS_CPU_KERNELS", "1") == "0":
        return "LIGHTNING_MRS_CPU_KERNELS=0"
    if not available(key.dtype):
        return f"the library could not be built: {build_error()}"
    return None


def _fn(kind: str, dtype: torch.dtype):
    fns = _STATE.setdefault("fns", {})  # (kind, dtype) -> ctypes function; goes with the library
    fn = fns.get((kind, dtype))  # type: ignore[attr-defined]
    if fn is None:
        lib = _lib()
        name = f"mrs_{kind}_{_SUFFIX[dtype]}"
        if lib is None or not hasattr(lib, name):
            raise RuntimeError(f"lightning_mrs: CPU kernel {name} is not available ({build_error()})")
        fn = fns[(kind, dtype)] = getattr(lib, name)  # type: ignore[index]
    return fn


def kernel_weight(w: Optional[Tensor]) -> Optional[Tensor]:
    """The per-phasor gain ``(P,)`` as the kernels read it: a contiguous float32, bfloat16 or
    float16 tensor (read in place, converted inside the kernel); other dtypes become float32."""
    if w is None or (w.dtype in _WKIND and w.is_contiguous()):
        return w
    return w.detach().to(torch.float32).contiguous()  # (P,)


def threads(numel: int) -> int:
    """Threads for a call on ``numel`` elements: one below :data:`MIN_NUMEL_PER_THREAD` each."""
    if numel < 2 * MIN_NUMEL_PER_THREAD:
        return 1
    return max(1, min(torch.get_num_threads(), numel // MIN_NUMEL_PER_THREAD))


# The row kernels are the op's fast path (RowsPlan in lightning_mrs.ops.plan): on a token they take
# about as long as the Python around them, so these two do nothing they need not do.
def rows_forward(x: Tensor, w: Optional[Tensor], eps: float, groups: int, rows: int, channels: int,
                 with_rsum: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """``(y, r_sum)`` for a contiguous ``x`` read as ``(groups, rows, channels)``, one ``S`` per
    group (``r_sum = P * S``, float32 ``(groups,)``; ``None`` unless ``with_rsum``); ``y`` has
    ``x``'s shape. ``w``: ``None`` or a :func:`kernel_weight`. No checks: the callers made them."""
    y = torch.empty_like(x)
    if with_rsum:
        r_sum = torch.empty(groups, dtype=torch.float32)  # (groups,)
        r_ptr = r_sum.data_ptr()
    else:
        r_sum = r_ptr = None
    w_ptr, w_kind = (None, 0) if w is None else (w.data_ptr(), _WKIND[w.dtype])
    numel = groups * rows * channels
    nt = 1 if numel < 2 * MIN_NUMEL_PER_THREAD else threads(numel)  # threads(), without the call
    _fn("fwd_rows", x.dtype)(x.data_ptr(), w_ptr, w_kind, y.data_ptr(), r_ptr, groups, rows, channels, eps, nt)
    return y, r_sum


def rows_backward(x: Tensor, w: Optional[Tensor], r_sum: Tensor, g: Tensor, eps: float, groups: int,
                  rows: int, channels: int, need_dw: bool) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx, dw)`` of :func:`rows_forward` for ``g`` shaped like ``x`` (contiguous, float32
    ``r_sum``); ``dw`` is ``(P,)`` float32, or ``None`` without a weight or ``need_dw``."""
    dx = torch.empty_like(x)
    if w is None:
        w_ptr, w_kind, dw = None, 0, None
    else:
        w_ptr, w_kind = w.data_ptr(), _WKIND[w.dtype]
        dw = torch.empty(channels // 2, dtype=torch.float32) if need_dw else None  # (P,)
    _fn("bwd_rows", x.dtype)(
        x.data_ptr(), g.data_ptr(), w_ptr, w_kind, r_sum.data_ptr(), dx.data_ptr(),
        None if dw is None else dw.data_ptr(), groups, rows, channels, eps, threads(groups * rows * channels),
    )
    return dx, dw


# --- the backend interface (see lightning_mrs.ops.dispatch.Backend) -------------------------
def forward(x3: Tensor, w: Optional[Tensor], eps: float, layout: Layout) -> tuple[Tensor, Tensor]:
    """``(y3, r_sum)`` for a contiguous canonical view accepted by :func:`unavailable`
    (``r_sum = P * S``, float32, ``(A, 1, 1)``)."""
    groups, rows, cols = x3.shape  # (A, L, C) if last else (A, C, L): one S per group
    w = kernel_weight(w)
    if layout.last:
        y3, r_sum = rows_forward(x3, w, eps, groups, rows, cols)
        return y3, r_sum.view(groups, 1, 1)
    y3 = torch.empty_like(x3)
    r_sum = torch.empty(groups, 1, 1, dtype=torch.float32)  # (A, 1, 1)
    w_ptr, w_kind = (None, 0) if w is None else (w.data_ptr(), _WKIND[w.dtype])
    _fn("fwd_sample", x3.dtype)(x3.data_ptr(), w_ptr, w_kind, y3.data_ptr(), r_sum.data_ptr(), groups, rows, cols,
                                eps, threads(x3.numel()))
    return y3, r_sum


def backward(x3: Tensor, w: Optional[Tensor], r_sum: Tensor, g3: Tensor, eps: float,
             layout: Layout) -> tuple[Tensor, Optional[Tensor]]:
    """``(dx3, dw)`` for ``g3`` shaped like ``x3``; ``dw`` is ``(P,)`` float32, or ``None``
    without a weight."""
    groups, rows, cols = x3.shape
    g3 = g3.contiguous()
    r_sum32 = r_sum.to(torch.float32).contiguous()  # (A, 1, 1)
    w = kernel_weight(w)
    if layout.last:
        return rows_backward(x3, w, r_sum32, g3, eps, groups, rows, cols, need_dw=True)
    dx3 = torch.empty_like(x3)
    w_ptr, w_kind = (None, 0) if w is None else (w.data_ptr(), _WKIND[w.dtype])
    dw = torch.empty(rows // 2, dtype=torch.float32) if w is not None else None  # (P,)
    ptrs = (x3.data_ptr(), g3.data_ptr(), w_ptr, w_kind, r_sum32.data_ptr(), dx3.data_ptr(),
            None if dw is None else dw.data_ptr())
    _fn("bwd_sample", x3.dtype)(*ptrs, groups, rows, cols, eps, threads(x3.numel()))
    return dx3, dw
