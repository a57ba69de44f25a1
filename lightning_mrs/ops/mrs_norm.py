"""``mrs_norm`` and ``mrs_scale``: the MRSNorm op's public entry points.

Where the mean is taken (``docs/method.md#where-the-mean-is-taken``):

* ``channel_dim=-1`` (channels-last, tokens / NHWC): one ``S`` per position, mean over the
  ``P = C / 2`` phasors of the last dim. Drop-in for ``F.layer_norm(x, (C,))``.
* ``channel_dim=1`` (channels-first ``(N, C, *spatial)``): ``spatial=False`` gives one ``S``
  per (sample, position), ``spatial=True`` one ``S`` per sample, shared over all phasors at
  all positions (like ``GroupNorm(1, C)``).

How a call runs (:func:`normalize`, the router): ``docs/development.md#life-of-a-call``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd import forward_ad

from lightning_mrs.ops.dispatch import BACKENDS, ROUTES, check_backend, compiled_fallback, route_for
from lightning_mrs.ops.library import FWD, MRSNormFunction, fallback_fwd
from lightning_mrs.ops.reference import mrs_norm_reference, mrs_scale_reference
from lightning_mrs.ops.validation import check_inputs

__all__ = ["BACKENDS", "mrs_norm", "mrs_scale", "which_backend"]


def _formula_only() -> bool:
    # torch.func transforms wrap the tensors (no data pointer, no old-style Function); inside a
    # forward-AD dual level the kernels would drop the tangents (the Function has no jvp); a
    # trace records the plain formula, which it can save and replay
    return (torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0
            or torch._C._is_tracing())


def normalize(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
              backend: str, caller: str) -> Tensor:
    """:func:`mrs_norm` with the caller's name in error messages (the modules pass theirs)."""
    if torch.compiler.is_compiling():  # first: Dynamo must see nothing else of the eager path
        return _compiled(x, weight, eps, channel_dim, spatial, backend, caller)
    if _formula_only():
        channel_dim = check_inputs(x, weight, eps, channel_dim, spatial, caller)
        check_backend(backend, caller)
        return mrs_norm_reference(x, weight, eps, channel_dim, spatial)
    # dispatch.key_of inline (the hot path is this lookup and one operator call)
    route = ROUTES.get((type(x), x.shape, None if x.is_contiguous() else x.stride(), x.dtype,
                        None if x.is_cpu else x.device, eps, channel_dim, spatial, backend,
                        None if weight is None else (type(weight), weight.shape, weight.dtype,
                                                     None if weight.is_cpu else weight.device)))
    if route is None:  # a new kind of call: checked, and its kernel chosen
        route = route_for(x, weight, eps, channel_dim, spatial, backend, caller)
    if route.kernel == "eager":
        return mrs_norm_reference(x, weight, route.eps, route.channel_dim, spatial)
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return MRSNormFunction.apply(x, weight, route.eps, route.channel_dim, spatial, route.fallback, route)
    if route.fallback is None:
        return FWD(x, weight, route.eps, route.channel_dim, spatial)[0]
    return fallback_fwd(x, weight, route.eps, route.channel_dim, spatial, route.fallback, route)[0]


def _compiled(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool, backend: str,
              caller: str) -> Tensor:
    """What ``torch.compile`` traces: the checks, then the Function (the formula where exported)."""
    channel_dim = check_inputs(x, weight, eps, channel_dim, spatial, caller)
    check_backend(backend, caller)
    plain = type(x) in (Tensor, torch.nn.Parameter) and (weight is None or type(weight) in (Tensor, torch.nn.Parameter))
    if backend == "eager" or torch.compiler.is_exporting() or x.numel() == 0 or not plain:
        return mrs_norm_reference(x, weight, eps, channel_dim, spatial)
    if x.is_contiguous():
        form = "contiguous"
    elif x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last):
        form = "channels_last"
    else:
        form = "other"
    fallback = compiled_fallback(x.device.type, x.dtype, x.ndim, channel_dim, spatial, backend, form)
    return MRSNormFunction.apply(x, weight, float(eps), channel_dim, spatial, fallback)


def which_backend(x: Tensor, *, channel_dim: int = -1, spatial: bool = False, backend: str = "auto") -> str:
    """The implementation :func:`mrs_norm` runs for this input: ``"eager"`` (the reference
    formula) or a kernel of :data:`lightning_mrs.ops.dispatch.KERNELS`; either is a valid
    ``backend=`` (:data:`BACKENDS`).

    Example:
        >>> which_backend(torch.randn(8, 64, dtype=torch.float64))
        'torch'
    """
    if _formula_only() or torch.compiler.is_exporting():
        check_inputs(x, None, 1e-6, channel_dim, spatial, "which_backend")
        check_backend(backend, "which_backend")
        return "eager"
    return route_for(x, None, 1e-6, channel_dim, spatial, backend, "which_backend").kernel


def mrs_norm(
    x: Tensor,
    weight: Optional[Tensor] = None,
    eps: float = 1e-6,
    *,
    channel_dim: int = -1,
    spatial: bool = False,
    backend: str = "auto",
) -> Tensor:
    """Mean Root Square normalisation of ``x`` (phasor normalisation).

    Args:
        x: input of any floating dtype and any layout (views, ``channels_last``, slices);
            fp16/bf16 are computed in fp32 and returned in their own dtype.
        weight: optional per-phasor gain of shape ``(C // 2,)``, on ``x``'s device (any
            floating dtype: fp32 weights beside bf16 activations are fine).
        eps: added inside each phasor's root, keeps zeros finite (must be > 0).
        channel_dim: the dim that holds the ``C`` (even) channels; ``-1`` for channels-last,
            ``1`` for channels-first.
        spatial: share one ``S`` per sample (dim 0) over all other dims.
        backend: ``"auto"`` (default) picks the fastest implementation available (see
            :mod:`lightning_mrs.ops.dispatch`); ``"eager"`` is the reference formula;
            ``"cpp"``, ``"inductor"`` and ``"triton"`` force one kernel and raise a
            ``ValueError`` saying why when it cannot run this input.

    Returns:
        A tensor of the shape and dtype of ``x``, in its memory format when ``x`` is dense.

    Raises:
        ValueError: a bad argument (see :func:`lightning_mrs.ops.validation.check_inputs`).
        RuntimeError: the weight is on another device than ``x``.

    Example:
        >>> x = torch.randn(4, 16, 64)
        >>> y = mrs_norm(x, torch.ones(32))
        >>> y.shape
        torch.Size([4, 16, 64])
    """
    return normalize(x, weight, eps, channel_dim, spatial, backend, "mrs_norm")


def mrs_scale(x: Tensor, eps: float = 1e-6, *, channel_dim: int = -1, spatial: bool = False) -> Tensor:
    """The ensemble scale ``S`` of :func:`mrs_norm`, in fp32 for half inputs.

    Returns a tensor that broadcasts against ``x``: size 1 along the channel dim (and along
    every non-batch dim when ``spatial=True``).

    Example:
        >>> mrs_scale(torch.ones(2, 6)).shape  # one S per row: mean of sqrt(1 + 1 + eps)
        torch.Size([2, 1])
    """
    channel_dim = check_inputs(x, None, eps, channel_dim, spatial, "mrs_scale")
    return mrs_scale_reference(x, eps, channel_dim, spatial)
