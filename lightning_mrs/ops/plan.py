"""What one kind of call runs: the plans that :mod:`.dispatch` resolves once and caches.

A plan is built once per kind of call (:func:`lightning_mrs.ops.dispatch.plan_for`: the
arguments checked, the layout mapped, the backend chosen) and then runs every call of that
kind. Each plan has the same three entry points:

* ``plan(x, weight, eps)``: the result, differentiable (through :class:`.function.MRSNormFunction`
  when autograd records the call, the kernels alone when it does not);
* ``plan.forward(x, weight, eps) -> (y, r_sum)`` and
  ``plan.backward(x, weight, r_sum, g, eps, need_weight_grad) -> (dx, dw)``: the two kernels
  without autograd, for the Function and for the torch.library op of :mod:`.library` (what
  ``torch.compile`` calls). ``r_sum = P * S`` per group in the compute dtype, of shape
  :attr:`rsum_shape`.

============= ============================================================ =====================
plan          runs                                                         for
============= ============================================================ =====================
``RowsPlan``  the C++ row kernels on the tensor itself (no view, no copy)  ``auto`` choosing ``cpp``
              - the op's fast path, its cheapest case                      for contiguous channels-
                                                                           last tokens, one S per row
``FusedPlan`` a backend's kernels on the canonical 3-d view of the input    every other kernel
              (:mod:`.layout`), the result back in the input's layout
``EagerPlan`` the reference formula (:mod:`.reference`)                    ``backend="eager"``, empty inputs
============= ============================================================ =====================
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from lightning_mrs.ops import cpu_kernels
from lightning_mrs.ops.function import MRSNormFunction
from lightning_mrs.ops.layout import Canonical, like
from lightning_mrs.ops.reference import mrs_norm_reference
from lightning_mrs.ops.validation import compute_dtype

__all__ = ["EagerPlan", "FusedPlan", "Plan", "RowsPlan"]


def _records(x: Tensor, weight: Optional[Tensor]) -> bool:
    """Whether autograd records this call (then the Function runs and keeps ``P * S``)."""
    return torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad))


def _fresh(view: Tensor) -> Tensor:
    """The same memory as ``view`` in a tensor that is not a view (no ``_base``).

    A custom Function must not return a view created inside it (autograd then forbids
    in-place ops on it), and a view taken outside makes every in-place op on the result go
    through CopySlices (two full copies of the gradient per op in the backward).
    """
    out = view.new_empty(0)
    return out.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


class RowsPlan:
    """The C++ row kernels on a contiguous channels-last CPU tensor, one ``S`` per row of the
    last dim (tokens: the common case), with a weight (if any) the kernels read in place.
    Without autograd one kernel call and no saved ``S``."""

    backend = cpu_kernels.NAME
    like_x = True  # y and dx come from torch.empty_like(x): the strides the compiled op promises
    __slots__ = ("channel_dim", "spatial", "groups", "channels")

    def __init__(self, channel_dim: int, groups: int, channels: int) -> None:
        self.channel_dim, self.spatial, self.groups, self.channels = channel_dim, False, groups, channels

    @property
    def rsum_shape(self) -> tuple[int, ...]:
        return (self.groups,)

    def __call__(self, x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
        if _records(x, weight):
            return MRSNormFunction.apply(x, weight, eps, self)
        return cpu_kernels.rows_forward(x, weight, eps, self.groups, 1, self.channels, with_rsum=False)[0]

    def forward(self, x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
        return cpu_kernels.rows_forward(x, weight, eps, self.groups, 1, self.channels)  # type: ignore[return-value]

    def backward(self, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, g: Tensor, eps: float,
                 need_weight_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        g = g.contiguous()  # (..., C)
        if g.dtype != x.dtype:  # a hook or a loss may hand back another dtype
            g = g.to(x.dtype)
        dx, dw = cpu_kernels.rows_backward(x, weight, r_sum, g, eps, self.groups, 1, self.channels,
                                           need_weight_grad)
        if dw is None or weight.dtype == torch.float32:  # type: ignore[union-attr]
            return dx, dw  # dw: float32 from the kernels
        return dx, dw.to(weight.dtype)  # type: ignore[union-attr]


class FusedPlan:
    """One backend's forward and backward kernels on the canonical 3-d view of the input
    (:class:`~lightning_mrs.ops.layout.Canonical`); results come back in the input's layout."""

    like_x = False  # y and dx come back through the canonical view: strides to be checked
    __slots__ = ("backend", "kernels", "channel_dim", "spatial", "canonical")

    def __init__(self, backend: str, kernels: ModuleType, channel_dim: int, spatial: bool,
                 canonical: Canonical) -> None:
        self.backend, self.kernels, self.channel_dim, self.spatial = backend, kernels, channel_dim, spatial
        self.canonical = canonical

    @property
    def rsum_shape(self) -> tuple[int, ...]:
        a, _, l = self.canonical.shape3
        per_position_first = not (self.canonical.layout.last or self.spatial)  # (A, C, L): one S per (a, l)
        return (a, 1, l) if per_position_first else (a, 1, 1)

    def __call__(self, x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
        if _records(x, weight):
            return MRSNormFunction.apply(x, weight, eps, self)
        return self.forward(x, weight, eps)[0]

    def forward(self, x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
        canonical = self.canonical
        y3, r_sum = self.kernels.forward(canonical.view(x), weight, eps, canonical.layout)
        y = canonical.restore(y3)
        if canonical.relayout:
            # the view was a copy (one S per sample, channels mid-memory): give y x's layout back
            return torch.empty_like(x).copy_(y), r_sum
        return _fresh(y), r_sum

    def backward(self, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, g: Tensor, eps: float,
                 need_weight_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        canonical = self.canonical
        dx3, dw = self.kernels.backward(canonical.view(x), weight, r_sum, canonical.view(like(g, x)), eps,
                                        canonical.layout)
        return canonical.restore(dx3), (dw.to(weight.dtype) if need_weight_grad else None)  # type: ignore[union-attr]


class EagerPlan:
    """The reference formula, differentiated by autograd (``backend="eager"``, empty inputs).

    Its ``forward``/``backward`` (the torch.library ops', which run below autograd, see
    :mod:`.library`) are the torch backend's bodies, the same maths as the formula (tested
    equal); on an empty input, empty results and a zero weight gradient."""

    backend = "eager"
    like_x = False
    __slots__ = ("channel_dim", "spatial", "groups", "bodies")

    def __init__(self, channel_dim: int, spatial: bool, groups: int, bodies: Optional[FusedPlan]) -> None:
        self.channel_dim, self.spatial, self.groups, self.bodies = channel_dim, spatial, groups, bodies

    @property
    def rsum_shape(self) -> tuple[int, ...]:
        return (self.groups,) if self.bodies is None else self.bodies.rsum_shape

    def __call__(self, x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
        return mrs_norm_reference(x, weight, eps, self.channel_dim, self.spatial)

    def forward(self, x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
        if self.bodies is None:  # empty
            return torch.empty_like(x), x.new_zeros(self.groups, dtype=compute_dtype(x.dtype))
        return self.bodies.forward(x, weight, eps)

    def backward(self, x: Tensor, weight: Optional[Tensor], r_sum: Tensor, g: Tensor, eps: float,
                 need_weight_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        if self.bodies is None:
            return torch.zeros_like(x), (torch.zeros_like(weight) if need_weight_grad else None)  # type: ignore[arg-type]
        return self.bodies.backward(x, weight, r_sum, g, eps, need_weight_grad)


Plan = RowsPlan | FusedPlan | EagerPlan
