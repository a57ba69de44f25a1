"""``ModelCheckpoint`` whose ``save_last=True`` keeps ``last.ckpt`` at the latest validation.

Lightning 2.6 writes ``last.ckpt`` only when a monitored checkpoint is saved at the same step
("Only save last checkpoint if a checkpoint was actually saved"), so with ``monitor="val/top1"``
and ``save_top_k=1`` a run whose accuracy stops improving leaves ``last.ckpt`` at the last *best*
step: a crash (a killed job, a node lost) then resumes epochs behind, with nothing said.
Lightning 2.4 wrote it at every validation. The recipes keep the 2.4 meaning on every version:
after Lightning's own logic, a validation at which nothing was saved writes ``last.ckpt``.

Example:
    >>> checkpoint = LastCheckpoint(monitor="val/top1", mode="max", save_last=True)
    >>> checkpoint.CHECKPOINT_NAME_LAST
    'last'
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

__all__ = ["LastCheckpoint"]


class LastCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (every argument its own) with ``last.ckpt`` current at each
    validation when ``save_last=True``; see the module docstring for why.

    Example:
        >>> LastCheckpoint(save_last=True).save_last
        True
    """

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):  # Lightning saves here, after the epoch's validation
            self._keep_last_current(trainer)

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._keep_last_current(trainer)

    def _keep_last_current(self, trainer: "pl.Trainer") -> None:
        """After Lightning's own save point: ``last.ckpt`` when nothing was saved at this step
        (Lightning's own skip rule: sanity check, fast_dev_run, not fitting, saved already)."""
        if self.save_last is True and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
