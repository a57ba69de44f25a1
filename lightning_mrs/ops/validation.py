"""Argument checks of the MRSNorm op and the one rule of its numerics (``compute_dtype``).

Every entry point (the functional op, the modules, the statistics) checks its arguments
here, before any kernel runs, so that a bad call fails with a message that names the caller
and the fix instead of a wrong result or a crash inside a kernel.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["check_inputs", "compute_dtype", "phasor_channel_dim", "positive_number"]


def positive_number(value: object) -> bool:
    """A finite int or float above 0 (not a bool): what ``eps`` and DyT's ``alpha0`` accept."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype MRSNorm computes in for inputs of ``dtype``: float32 for float16/bfloat16
    (``x^2`` of a half overflows past 256), the dtype itself otherwise."""
    # two comparisons rather than ``in (...)``: TorchScript cannot read a global tuple,
    # and the reference formula that calls this is scripted by the modules' TorchScript path
    return torch.float32 if dtype == torch.float16 or dtype == torch.bfloat16 else dtype


def phasor_channel_dim(x: Tensor, channel_dim: int, caller: str) -> int:
    """``channel_dim`` of ``x`` as a non-negative index, checked to hold an even width.

    Raises:
        ValueError: a 0-d tensor, an out-of-range dim or an odd channel count, naming
            ``caller`` and the fix.
    """
    if x.ndim == 0:
        raise ValueError(f"{caller} expects a tensor with a channel dimension, got a 0-d tensor.")
    if not -x.ndim <= channel_dim < x.ndim:
        raise ValueError(
            f"{caller}: channel_dim={channel_dim} is out of range for a {x.ndim}-d input of "
            f"shape {tuple(x.shape)}."
        )
    channel_dim %= x.ndim
    channels = x.shape[channel_dim]
    if channels % 2:
        raise ValueError(
            f"{caller} pairs adjacent channels into phasors, so the channel dim must be even; "
            f"got {channels} channels (dim {channel_dim} of shape {tuple(x.shape)}). Pad or "
            "project to an even width."
        )
    return channel_dim


def check_inputs(
    x: Tensor,
    weight: Optional[Tensor],
    eps: float,
    channel_dim: int,
    spatial: bool,
    caller: str = "mrs_norm",
) -> int:
    """Validate the arguments of :func:`lightning_mrs.mrs_norm`; return the channel dim.

    The weight may have another floating dtype than ``x`` (mixed precision keeps fp32
    weights beside bf16 activations): the op computes in :func:`compute_dtype` and returns
    ``x``'s dtype. It must be on ``x``'s device, as for torch's own norms.

    Raises:
        ValueError: a non-floating tensor, an odd or absent channel dim, ``spatial`` with the
            channels on the batch dim, a weight of the wrong shape or dtype, or a
            non-positive ``eps``; the message names ``caller`` and the fix.
        RuntimeError: the weight is on another device than ``x`` (as torch's norms raise).
    """
    if not x.is_floating_point():
        raise ValueError(
            f"{caller} expects a floating-point tensor, got dtype {x.dtype}; convert the "
            "input first, e.g. x.float()."
        )
    channel_dim = phasor_channel_dim(x, channel_dim, caller)
    if spatial and (x.ndim < 2 or channel_dim == 0):
        raise ValueError(
            f"{caller}(spatial=True) shares one S per sample (dim 0) over all other dims, so "
            f"it needs at least 2 dims and the channels off dim 0; got shape {tuple(x.shape)} "
            f"with channel_dim={channel_dim}."
        )
    channels = x.shape[channel_dim]
    if weight is not None:
        if tuple(weight.shape) != (channels // 2,):
            raise ValueError(
                f"{caller}: weight must hold one value per phasor, shape ({channels // 2},) for "
                f"{channels} channels; got shape {tuple(weight.shape)}."
            )
        if not weight.is_floating_point():
            raise ValueError(
                f"{caller}: weight must be a floating-point tensor, got dtype {weight.dtype}."
            )
        if weight.is_meta and not x.is_meta:
            raise RuntimeError(
                f"{caller}: the weight is on the meta device (shape only, no values), the input on "
                f"{x.device}. Materialise the layer first: module.to_empty(device=x.device) then "
                "module.reset_parameters(), or load_state_dict(state, assign=True)."
            )
        if weight.device != x.device:
            raise RuntimeError(
                f"{caller}: expected all tensors to be on the same device, but the input is on "
                f"{x.device} and the weight on {weight.device}. Move the layer to the input's "
                "device (module.to(x.device)) or the input to the layer's."
            )
    if not eps > 0:
        raise ValueError(f"{caller}: eps must be > 0 (it keeps zeros finite), got {eps}.")
    return channel_dim
