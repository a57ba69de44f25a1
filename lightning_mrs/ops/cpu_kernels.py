"""The ``cpp`` backend: the CPU kernels of the operators ``mrs_norm_fwd``/``mrs_norm_bwd``
(``cpu_kernels.cpp``), built on first use.

Two layouts have a kernel, where Inductor's code falls short of torch's native norms (the peers of
``nn.LayerNorm`` and ``nn.GroupNorm(1, C)``; ``cpu_kernels.cpp``'s header says which views).

The library is compiled once per machine with the system C++ compiler (``$CXX``, else
``c++``/``g++``/``clang++``; OpenMP, ``-O3 -march=native``, torch's headers) into a cache folder
(``$LIGHTNING_MRS_CACHE``, else ``~/.cache/lightning_mrs``), keyed by the sources, torch's
version, the compiler and the CPU's instruction sets, and imported as a Python extension module
whose ``activate()`` registers its kernels with torch's dispatcher (``LIGHTNING_MRS_CPU_NATIVE=0``:
the portable build, without ``-march=native``). Which kernels it holds is its *kernel set*
(:data:`KERNEL_SETS`; ``LIGHTNING_MRS_CPU_KERNEL_SET``, or :func:`using` for a block of code):
``auto`` runs the faster of ``cpu_avx2.h``'s kernels and the compiler-vectorised loops for each
dtype on this CPU, as measured (with AVX512_BF16 the kernels over ``cpu_avx512.h``'s 16 lanes);
:func:`loaded_kernels` says which. Nothing happens at import time; :func:`available` builds. If
the build fails (no compiler, no OpenMP, no headers), :func:`available` is ``False``,
:func:`build_error` says why and ``backend="auto"`` takes the next backend.
``LIGHTNING_MRS_CPU_KERNELS=0`` turns this path off.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from lightning_mrs.ops import cpp_build

__all__ = ["KERNEL_SETS", "available", "build_error", "build_flags", "kernel_set", "loaded_kernels",
           "min_numel_per_thread", "threads", "using"]

SOURCE = Path(__file__).with_suffix(".cpp")  # cpu_kernels.cpp, beside this file
#: what the sources include, directly or not: part of the cache key
HEADERS = tuple(SOURCE.with_name(h) for h in ("cpu_half.h", "cpu_rows.h", "cpu_sample.h", "cpu_avx2.h",
                                              "cpu_avx512.h"))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOCK = threading.Lock()
#: ``auto``, ``avx2`` (cpu_avx2.h's kernels for every dtype; needs AVX2, FMA and F16C and
#: ``-march=native``), ``generic`` (the compiler-vectorised loops of cpu_kernels.cpp everywhere).
KERNEL_SETS = ("auto", "avx2", "generic")
_DEFINES = {"auto": [], "avx2": ["-DMRS_KERNELS_AVX2"], "generic": ["-DMRS_KERNELS_GENERIC"]}
#: mrs_kernel_set() of the library -> the kernels it runs (loaded_kernels)
_LOADED = {1: "generic", 2: "avx2", 3: "avx2 for float16, generic for float32 and bfloat16", 4: "avx512"}
# The state of the kernel set in use: "set" (its name), "lib" (the imported module or None),
# "error", "flags", "kernels". One dict per set in _SETS; using() swaps _STATE.
_STATE: dict[str, object] = {}
_SETS: dict[str, dict[str, object]] = {}
_ACTIVE: list[ModuleType] = []  # the build whose kernels the dispatcher runs (at most one)


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
    cached): they are registered with the dispatcher for the block, so eager calls and compiled
    graphs alike run them, process-wide (benchmarks, comparisons; ``LIGHTNING_MRS_CPU_KERNEL_SET``
    for a whole run).

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
        yield
    finally:
        _STATE = before
        if _STATE.get("lib") is not None:
            _activate(_STATE["lib"])  # type: ignore[arg-type]
        elif _ACTIVE:  # the set before was never built: the next call builds and registers it
            _ACTIVE.pop().deactivate()


def _activate(lib: ModuleType) -> None:
    """Make ``lib``'s kernels the ones the dispatcher runs for the CPU."""
    if _ACTIVE and _ACTIVE[0] is lib:
        return
    if _ACTIVE:
        _ACTIVE.pop().deactivate()
    lib.activate()
    _ACTIVE.append(lib)


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


def _torch_flags() -> list[str]:
    """What compiling against torch and Python needs (torch's headers want C++20, as torch itself)."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}",
            f"-I{sysconfig.get_paths()['include']}", f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}"]


def _build() -> ModuleType:
    cxx = cpp_build.compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
    contents = [f.read_bytes() for f in (SOURCE, *HEADERS)]
    contents += [cpp_build.cpu_signature().encode(), torch.__version__.encode()]
    errors = []
    for flags in _flag_sets():
        flags = [f for f in flags if not f.startswith("-std=")] + _torch_flags()
        target, error = cpp_build.compile_cached("mrs_norm_cpu", cxx, flags, [SOURCE], contents,
                                                 libs=("-ltorch_cpu", "-lc10"))
        if error is not None:
            lines = [ln for ln in error.splitlines() if "error" in ln] or error.splitlines()
            errors.append(f"{' '.join(flags[:8])}: {' | '.join(lines[:3])[-400:]}")
            continue
        spec = importlib.util.spec_from_file_location("lightning_mrs_cpu", target)
        lib = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(lib)  # type: ignore[union-attr]
        _STATE["flags"] = " ".join(flags)
        _STATE["kernels"] = _LOADED[lib.kernel_set()]
        return lib
    raise RuntimeError(f"compiling {SOURCE.name} with {cxx} failed: " + " | ".join(errors))


def _lib() -> Optional[ModuleType]:
    """The build of the kernel set in use (built on the first call), registered with the dispatcher."""
    if "lib" not in _STATE:
        _STATE.setdefault("set", _env_kernel_set())  # a bad name raises here, at the first call, not as a warning
        with _LOCK:
            if "lib" not in _STATE:
                try:
                    _STATE["lib"] = _build()
                except Exception as err:  # no compiler, no OpenMP, no headers, unwritable cache...
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
    lib = _STATE["lib"]
    if lib is not None:
        _activate(lib)  # type: ignore[arg-type]
    return lib  # type: ignore[return-value]


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels for ``dtype`` (float32, bfloat16, float16) can run here (builds the
    library on the first call)."""
    if os.environ.get("LIGHTNING_MRS_CPU_KERNELS", "1") == "0" or dtype not in DTYPES:
        return False
    return _lib() is not None


def build_error() -> Optional[str]:
    """Why the library could not be built, or ``None``."""
    return _STATE.get("error")  # type: ignore[return-value]


def loaded_kernels() -> Optional[str]:
    """Which kernels the loaded library runs (a value of ``_LOADED``), ``None`` before it is built
    or when it could not be."""
    return _STATE.get("kernels")  # type: ignore[return-value]


def build_flags() -> Optional[str]:
    """The compiler flags of the loaded library, or ``None`` before it is built or when it could not be."""
    return _STATE.get("flags")  # type: ignore[return-value]


def _loaded() -> ModuleType:
    lib = _lib()
    if lib is None:
        raise RuntimeError(f"the C++ kernels are not built here: {build_error()}")
    return lib


def threads(numel: int) -> int:
    """The OpenMP threads of a call on ``numel`` elements: one below twice
    :func:`min_numel_per_thread` (waking a team costs more than the work), else up to torch's."""
    return _loaded().threads(numel)


def min_numel_per_thread(numel: int = 0) -> int:
    """The elements per thread below which calls run on fewer threads (2^15); ``numel > 0`` sets
    it (tests) and the previous value is returned."""
    return _loaded().min_numel_per_thread(numel)
