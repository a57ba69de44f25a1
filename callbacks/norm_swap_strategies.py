"""The strategies NormSwap refuses, and the model it needs under ``ModelParallelStrategy``.

``FSDPStrategy`` and DeepSpeed wrap and shard the parameters themselves; the multiprocessing
launcher (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) loads rank 0's weights into a model in
the main process that no callback swaps. Both are refused in ``NormSwap.setup``, with the fix.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from torch import nn

__all__ = ["refuse_parallelised", "refuse_unsupported"]


def refuse_unsupported(trainer: "pl.Trainer") -> None:
    """FSDP1, DeepSpeed and the multiprocessing launchers, refused before anything is swapped."""
    strategy = trainer.strategy
    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        raise MisconfigurationException(
            f"NormSwap does not support {type(strategy).__name__}: it wraps and shards the parameters itself, so norm "
            "layers cannot be replaced module by module once the strategy owns them (and Lightning runs it on GPUs "
            "only). Use FSDP2 instead: strategy=ModelParallelStrategy(), the model built in __init__ and sharded with "
            "torch.distributed.fsdp.fully_shard in configure_model; NormSwap swaps before that. Or call "
            "`lightning_mrs.swap_norms(self.<backbone>)` at the end of your LightningModule's __init__ and remove "
            "NormSwap from the callbacks. Supported strategies: single device, DDP (strategy='ddp') and "
            "ModelParallelStrategy (FSDP2)."
        )
    if isinstance(strategy.launcher, _MultiProcessingLauncher):
        raise MisconfigurationException(
            "NormSwap does not support strategy='ddp_spawn', 'ddp_fork' or 'ddp_notebook' (Lightning's "
            "multiprocessing launcher): the worker processes would swap and train their own copies of the model, "
            "then Lightning loads rank 0's weights into the main process's model, which no callback can swap, and "
            "that load fails. Use strategy='ddp' (one script process per device), or, where only a fork works "
            "(notebooks), call `lightning_mrs.swap_norms(self.<backbone>)` at the end of your LightningModule's "
            "__init__ and remove NormSwap from the callbacks."
        )


def refuse_parallelised(pl_module: nn.Module) -> None:
    """Under ModelParallelStrategy the swap needs the model as ``__init__`` built it, unsharded."""
    from torch.distributed.tensor import DTensor

    sharded = [name for name, p in pl_module.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise MisconfigurationException(
            f"NormSwap: the model is already parallelised before the swap (DTensor parameters such as {sharded[0]!r}); "
            "under ModelParallelStrategy build the model in __init__ and shard it (fully_shard) in configure_model, "
            "which Lightning calls after NormSwap's setup."
        )
