"""A callback for the LM recipe's FSDP2 tests: an Inf in one process's gradient shard, and what each process did.

Pass it on the command line (``--trainer.callbacks+=helpers.fsdp2.PlantInf --trainer.callbacks.out DIR``,
with ``tests/`` importable): at step ``at`` rank 1 writes an Inf into its shard of the first parameter's
gradient, after the backward and before the loss scaler's check; every rank then records, per step, its
loss scale and whether its shards of the weights changed, in ``DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["PlantInf"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard on this process


class PlantInf(pl.Callback):
    def __init__(self, out: str, at: int = 1) -> None:
        self.out, self.at = out, at
        self.records: list[dict[str, Any]] = []
        self._before: list[torch.Tensor] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = list(pl_module.parameters())
        if trainer.global_step == self.at and trainer.global_rank == 1:
            _local(params[0].grad).view(-1)[0] = float("inf")
        self._before = [_local(p.detach()).clone() for p in params]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        after = [_local(p.detach()) for p in pl_module.parameters()]
        stepped = any(not torch.equal(a, b) for a, b in zip(self._before, after))
        self.records.append({"scale": float(trainer.precision_plugin.scaler.get_scale()), "stepped": stepped})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.records))
