"""``ForwardCaptureMonitor``: a logging-step monitor whose hooks watch the training forward only.

``OutlierMonitor`` (and, in the same way, ``AttentionMonitor``) capture what enters or leaves
modules during the *forward*: their capture registers its hooks in ``arm()`` and removes them
in ``disarm()``. This base class arms the capture at the start of every (micro-)batch of a
logging step and disarms it as soon as that training forward is over
(``on_before_backward``, at the latest ``on_train_batch_end``), so that backward
recomputation (activation checkpointing) and validation are never captured; it marks the
capture ``stepped`` before an optimizer step and finds the layers once at ``on_train_start``
(its warnings come at the start of training, not at the first logging step). The rest of the
life cycle is :class:`~lightning_mrs.callbacks.monitor_base.LoggingStepMonitor`'s.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_mrs.callbacks.monitor_base import LayerT, LoggingStepMonitor, StepCapture

__all__ = ["ArmedCapture", "ForwardCaptureMonitor"]


class ArmedCapture(StepCapture, Protocol):
    """A capture whose hooks come and go with each training forward (both idempotent)."""

    def arm(self) -> None: ...

    def disarm(self) -> None: ...


ArmedT = TypeVar("ArmedT", bound=ArmedCapture)


class ForwardCaptureMonitor(LoggingStepMonitor[LayerT, ArmedT]):
    """A :class:`~lightning_mrs.callbacks.monitor_base.LoggingStepMonitor` whose capture is armed
    for the training forward of each batch of a logging step only (see the module docstring)."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._discover(pl_module)  # warnings now, not at the first logging step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._capture is not None:
            self._capture.arm()  # every micro-batch of the logging step

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._capture is not None:
            self._capture.disarm()  # the training forward is over

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._capture is not None:
            self._capture.stepped = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._capture is not None:
            self._capture.disarm()  # at the latest; the next micro-batch of a logging step re-arms it
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
