"""``NormSwapMixin``: ``LightningModule.load_from_checkpoint`` of a module trained with ``NormSwap``.

Lightning's ``load_from_checkpoint`` builds a fresh module and loads the weights into it; no
callback runs, so nothing of lightning-mrs can step in unless the module asks: this mixin's
``on_load_checkpoint`` (which Lightning calls before loading the weights) rebuilds the recorded
swap (:func:`lightning_mrs.callbacks.swap_restore.rebuild_recorded`).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_mrs.callbacks.norm_swap import NormSwap
from lightning_mrs.callbacks.swap_record import find_record
from lightning_mrs.callbacks.swap_restore import rebuild_recorded

__all__ = ["NormSwapMixin"]


class NormSwapMixin:
    """Lets ``load_from_checkpoint`` of a LightningModule trained with ``NormSwap`` rebuild the swap.

    A fresh module has its original norms, and the checkpoint holds the swapped layers' weights,
    so a plain ``load_from_checkpoint`` ends in torch's ``Missing key(s) in state_dict``. Put this
    mixin before ``LightningModule`` in the bases: its ``on_load_checkpoint`` (Lightning calls it
    before loading the weights) rebuilds the layers the checkpoint records, so the weights load
    and the model computes what the trained one did. A module that overrides ``on_load_checkpoint``
    must call ``super().on_load_checkpoint(checkpoint)``. Under a ``Trainer`` whose callbacks hold
    a ``NormSwap``, the callback has swapped the module already and checks the checkpoint itself,
    so the mixin does nothing; without one (``trainer.predict(model, ckpt_path=...)``) it rebuilds.

    Raises:
        ValueError: the module cannot be made to match the record (another architecture), listing
            the layers that differ.

    Example:
        >>> class LitResNet(NormSwapMixin, pl.LightningModule):  # doctest: +SKIP
        ...     ...
        >>> model = LitResNet.load_from_checkpoint("last.ckpt")  # doctest: +SKIP
    """

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        parent = getattr(super(), "on_load_checkpoint", None)
        if callable(parent):
            parent(checkpoint)
        spec = find_record(checkpoint)
        if spec is None or not isinstance(self, nn.Module) or _normswap_attached(self):
            return
        try:
            rebuild_recorded(self, spec)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}.load_from_checkpoint (NormSwapMixin): {err}") from None


def _normswap_attached(module: nn.Module) -> bool:
    """A Trainer holds the module and a NormSwap is among its callbacks (that one swaps and checks)."""
    trainer: Optional[Any] = getattr(module, "_trainer", None)  # LightningModule.trainer raises when unattached
    return trainer is not None and any(isinstance(cb, NormSwap) for cb in getattr(trainer, "callbacks", ()))
