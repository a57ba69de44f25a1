"""One logging step's capture for ``GradientHomogeneityMonitor``: its hooks and what they collect.

A :class:`Capture` exists only while a logging step runs. Arming it registers a forward
pre-hook on each monitored norm layer, which hands the layer an alias of its input with a tensor
hook; during backward the tensor hooks add each layer's :class:`~lightning_mrs.stats.PhasorSums`
under the layer's name. Closing it removes the pre-hooks and ignores gradients still to come.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_mrs.swap.registry import norm_spec
    >>> ln = nn.LayerNorm(4)
    >>> capture = Capture([MonitoredLayer("ln", ln, norm_spec(ln))], step=0, device=torch.device("cpu"))
    >>> capture.arm()
    >>> ln(torch.randn(3, 4, requires_grad=True)).sum().backward()
    >>> capture.close()
    >>> capture.sums["ln"].count.item()
    3.0
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_mrs.callbacks.capture import Layer, LayerCapture, Warn, no_warning
from lightning_mrs.stats import PhasorSums, phasor_sums, weight_grad_stats
from lightning_mrs.swap.registry import NormSpec

__all__ = ["Capture", "MonitoredLayer"]


@dataclass
class MonitoredLayer(Layer):
    """A norm layer under watch: its qualified name, the module and its registry spec."""

    spec: NormSpec

    @property
    def num_phasors(self) -> int:
        return self.spec.num_channels // 2


class Capture(LayerCapture[MonitoredLayer]):
    """Hooks on ``layers`` for logging step ``step``, and the per-layer sums they collected
    (arguments and ``sums``: :class:`~lightning_mrs.callbacks.capture.LayerCapture`'s).

    Attributes:
        weights: MRS layer name -> :func:`lightning_mrs.stats.weight_grad_stats` of its weight
            gradient at the first optimizer step that owns the weight.
        scale: the GradScaler scale the backward ran with (``None`` without a scaler).
    """

    owner = "GradientHomogeneityMonitor"

    def __init__(self, layers: list[MonitoredLayer], step: int, device: torch.device, warn: Warn = no_warning) -> None:
        super().__init__(layers, step, device, warn)
        self.weights: dict[str, dict[str, Tensor]] = {}
        self.scale: Optional[float] = None
        self._open = True

    def _zeros(self, layer: MonitoredLayer, **kwargs: Any) -> PhasorSums:
        return PhasorSums.zeros(layer.num_phasors, **kwargs)

    def _hooks(self, layer: MonitoredLayer) -> list[Any]:
        return [layer.module.register_forward_pre_hook(partial(self._pre_hook, layer))]

    def close(self) -> None:
        """Remove every hook; gradients that still arrive are ignored. Idempotent."""
        self._open = False
        super().close()

    def _pre_hook(self, layer: MonitoredLayer, module: nn.Module, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
        if not args or not torch.is_grad_enabled():
            return None
        x = args[0]
        if not isinstance(x, Tensor) or not x.is_floating_point():
            return None
        # a trainable norm on a tensor nothing else differentiates (e.g. the raw input) still
        # has an input gradient: ask autograd for it; a frozen one is not worth a backward
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if not x.requires_grad and not trainable:
            return None
        channel_dim = layer.spec.channel_dim
        if x.ndim == 0 or not -x.ndim <= channel_dim < x.ndim or x.shape[channel_dim] != layer.spec.num_channels:
            self._warn(
                f"shape:{layer.name}",
                f"GradientHomogeneityMonitor: layer {layer.name!r} ({type(module).__name__}) got an input of shape "
                f"{tuple(x.shape)} without {layer.spec.num_channels} channels on dim {channel_dim}; it is not monitored. "
                "Register its layout with lightning_mrs.register_norm(...) if the registry guessed wrong.",
            )
            return None
        # a node of its own: its gradient is the one through this layer only (no full backward
        # hooks: those break on in-place activations)
        alias = x.view_as(x) if x.requires_grad else x.detach().requires_grad_()
        alias.register_hook(partial(self._grad_hook, layer, x.detach()))
        return (alias, *args[1:])

    def _grad_hook(self, layer: MonitoredLayer, x: Tensor, grad: Tensor) -> None:
        if self._open:  # else closed before backward reached this layer
            self.add(layer, lambda: phasor_sums(x, grad, layer.spec.channel_dim))

    def record_weights(self, optimizer: Any) -> None:
        """Weight-gradient figures of the MRS layers whose weight ``optimizer`` is about to step.

        Called before each optimizer step; a layer keeps its first record (with several
        optimizers, each layer's weight is read before the step of the one that owns it).
        Parameter gradients are already unscaled here (Lightning unscales before the hook).
        """
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for layer in self.layers:
            weight = getattr(layer.module, "weight", None)
            if (
                layer.spec.kind == "mrs" and layer.name not in self.weights and isinstance(weight, Tensor)
                and weight.grad is not None and id(weight) in owned
            ):
                self.weights[layer.name] = weight_grad_stats(weight.grad)
