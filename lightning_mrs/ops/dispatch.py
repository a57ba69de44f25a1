"""Which kernel runs a kind of call: the backend table, consulted once per kind of call.

:data:`KERNELS` lists the backends in the order ``backend="auto"`` tries them (what each covers:
``docs/performance.md#backends``); :data:`BACKENDS` is every value of ``backend=``. ``cpp`` on the
CPU and ``triton`` on CUDA are the kernels of the operator pair (:mod:`.library`); every other
choice runs the fallback pair. A :class:`Route` depends only on the key of :func:`key_of`, is built
on a miss of :data:`ROUTES` (``docs/development.md#life-of-a-call``; a bad call raises every time,
never cached), with the environment variables read then; :func:`clear_cache` forgets every route.
"""

from __future__ import annotations

import importlib
import os
import threading
from types import ModuleType
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from lightning_mrs.ops import cpu_kernels
from lightning_mrs.ops.layout import Canonical, DispatchKey
from lightning_mrs.ops.validation import check_inputs

__all__ = ["BACKENDS", "KERNELS", "ROUTES", "Route", "check_backend", "choose", "clear_cache", "compile_min_numel",
           "compiled_fallback", "get_backend", "key_of", "route_for"]

#: Kernel backend name -> module, in the order ``backend="auto"`` tries them.
KERNELS: dict[str, str] = {
    "triton": "lightning_mrs.ops.triton_kernels",
    "cpp": "lightning_mrs.ops.cpu_kernels",
    "inductor": "lightning_mrs.ops.inductor_kernels",
    "torch": "lightning_mrs.ops.torch_kernels",
}
#: ``auto`` (the default) picks the fastest available kernel, ``eager`` runs the reference formula,
#: a name of :data:`KERNELS` forces that kernel; every answer of ``which_backend`` is one of them.
BACKENDS: tuple[str, ...] = ("auto", "eager", *KERNELS)
_PLAIN = (Tensor, torch.nn.Parameter)  # a tensor subclass (DTensor...) runs the reference formula
_DEFAULT_COMPILE_MIN_NUMEL = 1 << 18  # 1 MiB of fp32: below, a compile is not worth its seconds
_MAX_ROUTES = 4096  # kinds of call seen by a process: a model has a few dozen


class Route(NamedTuple):
    """What a kind of call runs."""

    kernel: str  # which_backend's answer: "eager" (the reference formula) or a name of KERNELS
    channel_dim: int  # checked, non-negative
    eps: float
    fallback: Optional[str]  # None: the operator pair; else the backend the fallback pair runs
    canonical: Optional[Canonical]  # the kernels' view (None for the formula)


ROUTES: dict[tuple, Route] = {}
_LOCK = threading.Lock()
_SETTINGS: dict[str, int] = {}
_MODULES: dict[str, ModuleType] = {}


def get_backend(name: str) -> ModuleType:
    """The backend module called ``name`` (imported on first use: triton is heavy)."""
    module = _MODULES.get(name)
    if module is None:
        module = _MODULES[name] = importlib.import_module(KERNELS[name])
    return module


def compile_min_numel() -> int:
    """Elements from which ``auto`` compiles (``LIGHTNING_MRS_COMPILE_MIN_NUMEL``, read once)."""
    if "min_numel" not in _SETTINGS:
        _SETTINGS["min_numel"] = int(os.environ.get("LIGHTNING_MRS_COMPILE_MIN_NUMEL", _DEFAULT_COMPILE_MIN_NUMEL))
    return _SETTINGS["min_numel"]


def clear_cache() -> None:
    """Forget every route and re-read the environment variables on the next call."""
    with _LOCK:
        ROUTES.clear()
        _SETTINGS.clear()


def check_backend(backend: str, caller: str) -> None:
    """Raise a ``ValueError`` listing :data:`BACKENDS` for an unknown ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"{caller}: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")


def _cpp_unavailable(key: DispatchKey) -> Optional[str]:
    """Why the C++ kernels do not cover ``key``, or ``None`` (builds them on the first call that needs them)."""
    if key.device_type != "cpu":
        return f"the C++ kernels run on the CPU, not on {key.device_type}"
    if key.dtype not in cpu_kernels.DTYPES:
        return f"they cover float32/bfloat16/float16, not {key.dtype}"
    if not key.dense:
        return "they need the channels contiguous, or the positions contiguous with spatial=True, in a dense tensor"
    if not (key.layout.last or key.layout.spatial):
        return "they need the channels contiguous, or the positions contiguous with spatial=True"
    if os.environ.get("LIGHTNING_MRS_CPU_KERNELS", "1") == "0":
        return "LIGHTNING_MRS_CPU_KERNELS=0"
    if not cpu_kernels.available(key.dtype):
        return f"the library could not be built: {cpu_kernels.build_error()}"
    return None


def unavailable(name: str, key: DispatchKey, explicit: bool) -> Optional[str]:
    """Why backend ``name`` cannot run ``key`` (``explicit``: asked for by name), or ``None``."""
    if name == "cpp":
        return _cpp_unavailable(key)
    if name == "torch":
        return None  # the plain bodies run everywhere (any device, dtype and layout)
    return get_backend(name).unavailable(key, explicit)


def choose(key: DispatchKey, request: str = "auto") -> str:
    """The backend that ``request`` (``"auto"`` or a name of :data:`KERNELS`) means for ``key``
    (may build the C++ kernels, once per process).

    Raises:
        ValueError: an explicit request that cannot run ``key``, with the reason.
    """
    if request != "auto":
        reason = unavailable(request, key, explicit=True)
        if reason is not None:
            raise ValueError(
                f"mrs_norm(backend={request!r}) cannot run a {key.device_type} {key.dtype} input with "
                f"{'the channels' if key.layout.last else 'the positions'} innermost and "
                f"spatial={key.layout.spatial}: {reason}. Use backend='auto' to pick the best available kernel."
            )
        return request
    for name in KERNELS:
        if unavailable(name, key, explicit=False) is None:
            return name
    raise AssertionError("the torch backend runs everywhere")  # pragma: no cover


def key_of(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool, backend: str) -> tuple:
    """Every attribute that decides a route (the strides only when not contiguous, the device
    only off the CPU: is_cpu is the cheaper read); mrs_norm.normalize builds it inline."""
    return (type(x), x.shape, None if x.is_contiguous() else x.stride(), x.dtype, None if x.is_cpu else x.device,
            eps, channel_dim, spatial, backend,
            None if weight is None else (type(weight), weight.shape, weight.dtype,
                                         None if weight.is_cpu else weight.device))


def _build(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool, request: str,
           caller: str) -> Route:
    channel_dim = check_inputs(x, weight, eps, channel_dim, spatial, caller)
    check_backend(request, caller)
    plain = type(x) in _PLAIN and (weight is None or type(weight) in _PLAIN)
    if request == "eager" or x.numel() == 0 or not plain:
        return Route("eager", channel_dim, float(eps), None, None)
    canonical = Canonical.of(x, channel_dim, spatial)
    key = DispatchKey(x.device.type, x.dtype, canonical.layout, canonical.dense, x.numel() >= compile_min_numel())
    name = choose(key, request)
    on_op = name == "cpp" or (name == "triton" and key.device_type == "cuda")
    return Route(name, channel_dim, float(eps), None if on_op else name, canonical)


def route_for(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool, backend: str,
              caller: str = "mrs_norm") -> Route:
    """The route of this kind of call, built (and the arguments checked) on its first call.

    Raises:
        ValueError, RuntimeError: a bad argument, an unknown backend, or an explicit backend that
            cannot run the input.
    """
    key = key_of(x, weight, eps, channel_dim, spatial, backend)
    route = ROUTES.get(key)
    if route is None:
        route = _build(x, weight, eps, channel_dim, spatial, backend, caller)
        with _LOCK:
            if len(ROUTES) >= _MAX_ROUTES:
                ROUTES.clear()
            ROUTES[key] = route
    return route


@torch.compiler.assume_constant_result  # evaluated once when tracing, its answer kept in the graph
def compiled_fallback(device_type: str, dtype: torch.dtype, ndim: int, channel_dim: int, spatial: bool,
                      backend: str, form: str) -> Optional[str]:
    """What a compiled graph calls for an input of ``form`` (``contiguous``, ``channels_last`` or
    ``other``): ``None`` for the operator pair, else the request the fallback pair resolves when
    it runs (the number of elements may change the choice). Asked of :func:`route_for` on a
    probe of that kind, so the one router decides; sizes of 2 keep every stride meaningful."""
    if form == "other":  # any strides: the fallback pair looks at the real tensor
        return backend
    probe = torch.zeros((2,) * ndim, dtype=dtype, device=device_type)
    if form == "channels_last":
        probe = probe.contiguous(memory_format=torch.channels_last)
    return None if route_for(probe, None, 1e-6, channel_dim, spatial, backend).fallback is None else backend
