"""The step Lightning logs a training batch's ``self.log`` metrics at, from public trainer state.

Shared by the monitors (``GradientHomogeneityMonitor``, ``AttentionMonitor``): they capture
on these steps only, so that their figures appear where ``self.log``'s do.

Lightning logs a training batch's metrics at step ``n`` = the number of batches that stepped
before it, when ``(n + 1) % log_every_n_steps == 0`` (or ``trainer.should_stop``). What
"stepped" means depends on the optimization mode:

* automatic optimization: one optimizer step per ``accumulate_grad_batches`` batches, so
  ``n == trainer.global_step`` at the start of the batch (accumulation batches share the ``n``
  of the batch that steps, which is the one Lightning logs);
* manual optimization: every batch counts once, however many optimizers it steps
  (``trainer.global_step`` counts ``optimizer.step()`` calls instead), so the count is kept
  here, in the monitor's ``state_dict``.

Example:
    >>> steps = LoggingSteps("MyMonitor", "my/*")
    >>> [n for n in range(10) if steps.is_logging_step(n, 4)]
    [3, 7]
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import lightning.pytorch as pl

__all__ = ["LoggingSteps"]


class LoggingSteps:
    """Lightning's logging-step count ``n`` for the running fit (see the module docstring).

    Args:
        owner: the monitor's name, which starts its warnings.
        tags: its tags (``"phasor/*"``), named in its warnings.
    """

    def __init__(self, owner: str, tags: str) -> None:
        self.owner, self.tags = owner, tags
        self.batches = 0  # manual optimization: training batches completed, over the whole run
        self._restored = False
        self._trainer: Optional[weakref.ref] = None  # the trainer the count belongs to

    @staticmethod
    def manual(pl_module: pl.LightningModule) -> bool:
        return not pl_module.automatic_optimization

    def current(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """``n`` of the batch that runs now (call between its start and its end)."""
        return self.batches if self.manual(pl_module) else trainer.global_step

    def batch_done(self, pl_module: pl.LightningModule) -> None:
        """Count a finished batch (only manual optimization needs this)."""
        if self.manual(pl_module):
            self.batches += 1

    @staticmethod
    def is_logging_step(n: int, interval: int) -> bool:
        return interval > 0 and (n + 1) % interval == 0

    def start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Optional[str]:
        """Set the count at the start of training; a warning to give when it had to be guessed.

        A fresh run starts at 0; a resumed one continues from the monitor's checkpointed
        state, another ``fit`` of the same trainer from where the last one stopped. A
        manual-optimization run resumed from a checkpoint without that state (saved before the
        monitor kept it, or without the monitor) cannot know how many batches ran: the count
        is estimated as ``global_step // len(trainer.optimizers)`` (exact when every optimizer
        steps once per batch) and a warning says so.
        """
        restored, self._restored = self._restored, False
        same_trainer = self._trainer is not None and self._trainer() is trainer
        self._trainer = weakref.ref(trainer)
        if not self.manual(pl_module) or restored or same_trainer:
            return None
        if trainer.global_step == 0:
            self.batches = 0
            return None
        self.batches = trainer.global_step // max(len(trainer.optimizers), 1)
        return (
            f"{self.owner}: resuming a manual-optimization run from a checkpoint without the "
            f"monitor's batch count; it is estimated as global_step // {max(len(trainer.optimizers), 1)} optimizers "
            f"= {self.batches}, which holds only when every optimizer steps once per batch. If it is wrong, "
            f"{self.tags} figures are logged at other steps than self.log's until the next fresh run."
        )

    @staticmethod
    def run_length(trainer: pl.Trainer) -> float:
        """An upper bound on the logging-step count at the end of the run (``inf`` if unknown).

        ``trainer.estimated_stepping_batches``: the optimizer steps under automatic
        optimization; under manual optimization (no accumulation) ``min(max_steps, batches)``,
        at least the number of batches when every batch steps an optimizer.
        """
        try:
            length = trainer.estimated_stepping_batches
        except Exception:  # noqa: BLE001 - e.g. accumulation schedules: no estimate, no warning
            return math.inf
        return math.inf if length is None or length < 0 else float(length)

    def no_logging_step(self, start: int, end: float, interval: int, ended: bool) -> Optional[str]:
        """A warning when no logging step lies in ``[start, end)`` (``end``: the count at the
        end of the run, or :meth:`run_length` before it), else ``None``."""
        if interval <= 0 or end <= start:
            return None
        first = -(-(start + 1) // interval) * interval - 1  # the smallest logging step >= start
        if first < end:
            return None
        length = f"ended after step {int(end) - 1}" if ended else f"has at most {int(end)} steps"
        return (
            f"{self.owner}: log_every_n_steps={interval} but the run {length} (first logging step: {first}), "
            f"so no {self.tags} figure is logged. Lower {self.owner}(log_every_n_steps=...) or "
            "Trainer(log_every_n_steps=...)."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "batches" in state:
            self.batches = int(state["batches"])
            self._restored = True
