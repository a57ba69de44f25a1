"""``mrs_norm`` and ``mrs_scale``: the MRSNorm op's public entry points.

Where the mean is taken (``docs/method.md#where-the-mean-is-taken``):

* ``channel_dim=-1`` (channels-last, tokens / NHWC): one ``S`` per position, mean over the
  ``P = C / 2`` phasors of the last dim. Drop-in for ``F.layer_norm(x, (C,))``.
* ``channel_dim=1`` (channels-first ``(N, C, *spatial)``): ``spatial=False`` gives one ``S``
  per (sample, position), ``spatial=True`` one ``S`` per sample, shared over all phasors at
  all positions (like ``GroupNorm(1, C)``).

The arguments are checked here (:mod:`.validation`); then the reference formula runs
(:mod:`.reference`) or the fused autograd Function (:mod:`.function`) with the backend that
:mod:`.dispatch` picks.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_mrs.ops.dispatch import compile_min_numel, resolve
from lightning_mrs.ops.function import fused_mrs_norm
from lightning_mrs.ops.layout import Canonical, DispatchKey, canonical_of
from lightning_mrs.ops.reference import mrs_norm_reference, mrs_scale_reference
from lightning_mrs.ops.validation import check_inputs

__all__ = ["BACKENDS", "mrs_norm", "mrs_scale", "which_backend"]

#: The values of ``backend``: ``auto`` (the default) picks the fastest available kernel,
#: ``eager`` runs the reference formula, the others force one kernel (for benchmarks and bug
#: reports; see :mod:`lightning_mrs.ops.dispatch`).
BACKENDS = ("auto", "eager", "cpp", "inductor", "triton")


def _check_backend(backend: str, caller: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{caller}: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")


def _runs_eagerly(x: Tensor) -> bool:
    # inside torch.compile / torch.export the plain formula lets the outer graph fuse it (no
    # graph break); under torch.jit.trace it is what the trace can record and save
    return x.numel() == 0 or torch.compiler.is_compiling() or torch.jit.is_tracing()


def normalize(x: Tensor, weight: Optional[Tensor], eps: float, channel_dim: int, spatial: bool,
              backend: str, caller: str) -> Tensor:
    """:func:`mrs_norm` with the caller's name in error messages (the modules pass theirs)."""
    channel_dim = check_inputs(x, weight, eps, channel_dim, spatial, caller)
    _check_backend(backend, caller)
    if backend == "eager" or _runs_eagerly(x):
        return mrs_norm_reference(x, weight, eps, channel_dim, spatial)
    canonical = canonical_of(x, channel_dim, spatial)
    return fused_mrs_norm(x, weight, eps, channel_dim, spatial, _resolve(x, canonical, backend), canonical)


def _resolve(x: Tensor, canonical: Canonical, backend: str) -> str:
    large = x.numel() >= compile_min_numel()
    return resolve(DispatchKey(x.device.type, x.dtype, canonical.layout, canonical.dense, large), backend)


def which_backend(x: Tensor, *, channel_dim: int = -1, spatial: bool = False, backend: str = "auto") -> str:
    """The implementation :func:`mrs_norm` runs for this input: ``"eager"`` (the reference
    formula) or a backend of :data:`lightning_mrs.ops.dispatch.BACKENDS`.

    Example:
        >>> which_backend(torch.randn(8, 64, dtype=torch.float64))
        'torch'
    """
    channel_dim = check_inputs(x, None, 1e-6, channel_dim, spatial, "which_backend")
    _check_backend(backend, "which_backend")
    if backend == "eager" or _runs_eagerly(x):
        return "eager"
    return _resolve(x, canonical_of(x, channel_dim, spatial), backend)


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
