"""``OutlierMonitor``'s parts: which modules it watches, one logging step's capture, its metrics.

Which modules (:func:`find_norm_inputs`), in ``model.named_modules()`` order, each instance once:

1. every norm layer the swap registry knows (:func:`lightning_mrs.swap.registry.norm_spec`:
   torch's BatchNorm/InstanceNorm/GroupNorm/LayerNorm/RMSNorm/LocalResponseNorm, timm's and
   torchvision's norms, MRSNorm, and whatever :func:`lightning_mrs.register_norm` added), on
   the channel dim the registry gives; a subclass with its own ``forward`` (registry kind
   ``"custom"``) is watched with its channel dim read from the input's shape (rule 2);
2. any other module whose class name contains ``"Norm"`` and whose channel count ``C`` is
   given by a 1-d ``weight`` or an int / 1-tuple ``normalized_shape`` (transformers'
   ``LlamaRMSNorm``, ``T5LayerNorm``, a model's own RMSNorm...): channels on the last dim when
   the input's last dim has ``C`` entries, else on dim 1 when that one has;
3. not watched, and named in a warning: a registry norm whose ``normalized_shape`` spans
   several dims, and a childless module named like a norm without such a channel count.
   A module named like a norm that has children (a wrapper such as timm's
   ``NormMlpClassifierHead``) is not a norm itself: the norms inside it are found on their
   own. Weight parametrizations (``torch.nn.utils``: weight/spectral norm) normalise weights,
   not activations, and are not considered.

:class:`OutlierCapture` holds the forward pre-hooks of one logging step; each call reduces its
input to :class:`~lightning_mrs.outlier_stats.OutlierSums` at once.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    >>> layers, unwatchable = find_norm_inputs(net)
    >>> [(layer.name, layer.channel_dim, layer.num_channels) for layer in layers], unwatchable
    ([('1', -1, 6)], [])
    >>> capture = OutlierCapture(layers, step=0, device=torch.device("cpu"))
    >>> capture.arm()
    >>> _ = net(torch.randn(3, 4))
    >>> capture.disarm()
    >>> capture.sums["1"].tokens.item()
    3.0
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_mrs.callbacks.capture import Layer, LayerCapture
from lightning_mrs.outlier_stats import OutlierSums, outlier_sums
from lightning_mrs.swap.probe import looks_like_norm
from lightning_mrs.swap.registry import norm_spec

__all__ = ["OutlierCapture", "WatchedNorm", "find_norm_inputs"]


@dataclass
class WatchedNorm(Layer):
    """A norm layer whose input is watched.

    Attributes:
        name: its qualified name.
        module: the module.
        channel_dim: where its channels are; ``None``: read from each input's shape
            (last dim, else dim 1, holding ``num_channels`` entries).
        num_channels: ``C``; ``None``: whatever ``channel_dim`` holds (an uninitialised lazy norm).
        kind: the registry's kind, or ``"by name"`` (rule 2 of the module docstring).
    """

    channel_dim: Optional[int]
    num_channels: Optional[int]
    kind: str


def _channel_count(module: nn.Module) -> Optional[int]:
    """``C`` from an int / 1-tuple ``normalized_shape`` or a 1-d ``weight``, else ``None``."""
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, int):
        return shape
    if isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1 and isinstance(shape[0], int):
        return int(shape[0])
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.ndim == 1:
        return int(weight.shape[0])
    return None


def find_norm_inputs(model: nn.Module) -> tuple[list[WatchedNorm], list[tuple[str, str]]]:
    """The norm layers of ``model`` whose input can be watched, and ``(name, reason)`` of the
    norm-like modules that cannot (the rules are in the module docstring)."""
    watched: list[WatchedNorm] = []
    unwatchable: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        spec = norm_spec(module)
        if spec is not None and spec.kind == "probed" and spec.formula is None:
            spec = None  # named like a norm, but the probe could not read it: the by-name rules decide
        shape = getattr(module, "normalized_shape", None)
        if spec is not None and isinstance(shape, (tuple, list, torch.Size)) and len(shape) != 1:
            unwatchable.append((name, f"its normalized_shape {tuple(shape)} spans {len(shape)} dims, not one channel dim"))
        elif spec is not None:
            by_shape = spec.kind == "custom"  # forward overridden: the registry's layout is a guess
            channels = None if spec.kind == "lazy" else spec.num_channels
            watched.append(WatchedNorm(name, module, None if by_shape else spec.channel_dim, channels, spec.kind))
        elif looks_like_norm(module):
            channels = _channel_count(module)
            if channels is not None:
                watched.append(WatchedNorm(name, module, None, channels, "by name"))
            elif next(module.children(), None) is None:  # a wrapper's norms are found on their own
                unwatchable.append((name, "no 1-d weight or normalized_shape tells its channel count"))
    return watched, unwatchable


class OutlierCapture(LayerCapture[WatchedNorm]):
    """The per-layer statistics of logging step ``step`` (``OutlierCapture(layers, step, device, warn)``,
    see :class:`~lightning_mrs.callbacks.capture.LayerCapture`), and the forward pre-hooks that collect them."""

    owner = "OutlierMonitor"

    def _zeros(self, layer: WatchedNorm, **kwargs: Any) -> OutlierSums:
        return OutlierSums.zeros(**kwargs)

    def _hooks(self, layer: WatchedNorm) -> list[Any]:
        return [layer.module.register_forward_pre_hook(partial(self._hook, layer), with_kwargs=True)]

    def _channel_dim(self, layer: WatchedNorm, x: Tensor) -> Optional[int]:
        """Where ``x``'s channels are, or ``None`` (after a warning) when it has none of ``layer``'s."""
        c, dim = layer.num_channels, layer.channel_dim
        if dim is not None and -x.ndim <= dim < x.ndim and (c is None or x.shape[dim] == c):
            return dim
        if dim is None and x.ndim >= 1 and x.shape[-1] == c:
            return -1
        if dim is None and x.ndim >= 2 and x.shape[1] == c:
            return 1
        where = f"on dim {dim}" if dim is not None else "on the last dim or dim 1"
        self._warn(f"shape:{layer.name}", (
            f"OutlierMonitor: layer {layer.name or 'root'!r} ({type(layer.module).__name__}) got an input of shape "
            f"{tuple(x.shape)} without {c} channels {where}; that input is not watched. Register its layout with "
            "lightning_mrs.register_norm(...)."))
        return None

    def _hook(self, layer: WatchedNorm, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, Tensor)), None)
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.numel() == 0:
            return
        dim = self._channel_dim(layer, x)
        if dim is not None:
            self.add(layer, lambda: outlier_sums(x, dim))
