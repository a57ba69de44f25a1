"""The dispatch of a call: the backend table, and the one cache of plans.

**The backends.** Every backend is a module that implements :class:`Backend`: a ``forward``
and a ``backward`` on the canonical 3-d views of :mod:`lightning_mrs.ops.layout`, and
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

The choice (:func:`choose`) depends only on the :class:`DispatchKey` (device type, dtype,
layout, whether the view is dense, whether the tensor is large) and on the request.

**The plan of a call.** Everything decided before a kernel runs - the argument checks, the
canonical view, the backend, whether the C++ row kernels can take the tensor as it is -
depends only on what kind of call it is: the input's type, shape, strides (only whether it is
contiguous, when it is), dtype and device, the weight's type, shape, dtype, device and
contiguity, ``eps``, ``channel_dim``, ``spatial`` and the request. :func:`plan_for` looks
that key up in one cache (:data:`PLANS`); on a miss it checks the arguments
(:mod:`.validation`: a bad call raises there, every time, and is never cached), maps the
layout, chooses the backend and builds a plan (:mod:`.plan`), which then runs every call of
that kind. The op's fast path is the cheapest plan, not a second router: a dozen attribute
reads, one dict lookup, one kernel call. The environment variables
(``LIGHTNING_MRS_CPU_KERNELS``, ``LIGHTNING_MRS_COMPILE_MIN_NUMEL``, ``TRITON_INTERPRET``) are
read when a plan is built; :func:`clear_cache` forgets every plan (tests, or after changing
those variables).

One eager call of ``MRSNorm.forward`` visits, in order and once each: ``modules.py`` (the
layer's width check) -> ``mrs_norm.py`` (``normalize``: ``torch.compile``, ``torch.func`` and
tracing go elsewhere) -> ``dispatch.py`` (:func:`run`: the key and the lookup) -> ``plan.py``
(the plan runs) -> ``function.py`` (only when autograd records the call) -> the backend
(``cpu_kernels.py`` for tokens on the CPU). A miss adds ``validation.py``, ``layout.py`` and
the backends' ``unavailable`` once per kind of call.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Optional, Protocol

import torch
from torch import Tensor

from lightning_mrs.ops import cpu_kernels
from lightning_mrs.ops.layout import Canonical, DispatchKey, Layout
from lightning_mrs.ops.plan import EagerPlan, FusedPlan, Plan, RowsPlan
from lightning_mrs.ops.validation import check_inputs

__all__ = [
    "BACKENDS", "Backend", "KERNELS", "PLANS", "check_backend", "choose", "clear_cache", "compile_min_numel",
    "get_backend", "plan_for", "run",
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
_ROW_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))  # what the C++ kernels read in place
_ROW_TYPES = (Tensor, torch.nn.Parameter)  # not a tensor subclass (DTensor...): the general plan
_DEFAULT_COMPILE_MIN_NUMEL = 1 << 18  # 1 MiB of fp32: below, a compile is not worth its seconds
_MAX_PLANS = 4096  # kinds of call seen by a process: a model has a few dozen


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


#: The plan of every kind of call seen so far (see the module docstring for the key).
PLANS: dict[tuple, Plan] = {}
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
    """Forget every plan and re-read the environment variables on the next call."""
    with _LOCK:
        PLANS.clear()
        _SETTINGS.clear()


def check_backend(backend: str, caller: str) -> None:
    """Raise a ``ValueError`` listing :data:`BACKENDS` for an unknown ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"{caller}: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")


def choose(key: DispatchKey, request: str = "auto") -> str:
    """The backend that ``request`` (``"auto"`` or a name of :data:`KERNELS`) means for ``key``
    (may build the C++ kernels, once per process).

    Raises:
        ValueError: an explicit request that cannot run ``key``, with the reason.
    """
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


def _build(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool, request: str,
           caller: str) -> Plan:
    channel_dim = check_inputs(x, weight, eps, channel_dim, spatial, caller)
    check_backend(request, caller)
    numel = x.numel()
    groups = x.shape[0] if spatial else (numel // x.shape[channel_dim] if numel else 0)
    canonical = Canonical.of(x, channel_dim, spatial) if numel else None
    if request == "eager" or canonical is None:
        bodies = None if canonical is None else FusedPlan("torch", get_backend("torch"), channel_dim, spatial, canonical)  # type: ignore[arg-type]
        return EagerPlan(channel_dim, spatial, groups, bodies)
    key = DispatchKey(x.device.type, x.dtype, canonical.layout, canonical.dense, numel >= compile_min_numel())
    backend = choose(key, request)
    if backend == cpu_kernels.NAME and request == "auto" and _rows_take(x, weight, canonical):
        return RowsPlan(channel_dim, groups, x.shape[channel_dim])
    return FusedPlan(backend, get_backend(backend), channel_dim, spatial, canonical)  # type: ignore[arg-type]


def _rows_take(x: Tensor, weight: Optional[Tensor], canonical: Canonical) -> bool:
    """The C++ row kernels can take ``x`` and ``weight`` as they are (no view, no conversion)."""
    return (
        canonical.layout == _ROWS and type(x) is Tensor and x.is_contiguous()
        and (weight is None or (type(weight) in _ROW_TYPES and weight.is_contiguous() and weight.dtype in _ROW_DTYPES))
    )


def plan_for(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool, backend: str,
             caller: str = "mrs_norm") -> Plan:
    """The plan of this kind of call, built (and the arguments checked) on its first call.

    Raises:
        ValueError, RuntimeError: a bad argument (:func:`lightning_mrs.ops.validation.check_inputs`),
            an unknown backend, or an explicit backend that cannot run the input.
    """
    # every attribute that decides a plan; the strides only when they are not the contiguous
    # ones, the device only off the CPU (is_cpu is the cheaper read)
    key = (
        type(x), x.shape, None if x.is_contiguous() else x.stride(), x.dtype, None if x.is_cpu else x.device,
        eps, channel_dim, spatial, backend,
        None if weight is None else (
            type(weight), weight.shape, weight.dtype, None if weight.is_cpu else weight.device, weight.is_contiguous()
        ),
    )
    plan = PLANS.get(key)
    if plan is None:
        plan = _build(x, weight, eps, channel_dim, spatial, backend, caller)
        with _LOCK:
            if len(PLANS) >= _MAX_PLANS:
                PLANS.clear()
            PLANS[key] = plan
    return plan


def run(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool, backend: str,
        caller: str) -> Tensor:
    """The op on ``x``: its plan (:func:`plan_for`), run."""
    return plan_for(x, weight, eps, channel_dim, spatial, backend, caller)(x, weight, eps)
