"""The LM recipe's model as a Hugging Face directory that ``lightning_mrs.from_pretrained`` loads back.

At the end of every fit the LM recipe writes ``<run>/hf/`` (``--export``, :class:`ExportHF`): the
model's ``save_pretrained`` (the norm swap recorded in ``config.json``, see
``docs/transformers.md#saving-and-loading-back``) and the tokenizer of ``--model.pretrained``
when there is one. From a checkpoint: ``python recipes/export_hf.py`` (:func:`load_lm`, :func:`export`).

Example:
    >>> import lightning_mrs
    >>> model = lightning_mrs.from_pretrained("<out_dir>")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

__all__ = ["ExportHF", "export", "load_lm"]


def export(lm: Any, out: Union[str, os.PathLike], tokenizer: Optional[Any] = None) -> Path:
    """Write ``lm.model`` (``save_pretrained``) and ``tokenizer`` into ``out``; return ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lm.model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_lm(checkpoint: Union[str, os.PathLike]) -> Any:
    """The recipe's module from a checkpoint: a ``.ckpt`` file or FSDP2's directory of shards."""
    from recipes.text.byte_lm import ByteLM

    return ByteLM.load_from_checkpoint(checkpoint, map_location="cpu")


class ExportHF(Callback):
    """At the end of a fit, export the model (and the data's tokenizer) as a Hugging Face directory.

    Args:
        path: where; ``None``: ``<log_dir>/hf``.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self.written: Optional[Path] = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if getattr(pl_module, "_sharded", False):
            rank_zero_info("export: the model is sharded (FSDP2); export it from the checkpoint: python "
                           "recipes/export_hf.py <run>/checkpoints/last.ckpt <out_dir>")
            return
        # trainer.log_dir broadcasts from rank 0, so every rank must ask for it, not rank 0 alone
        root = self.path or os.path.join(trainer.log_dir or trainer.default_root_dir, "hf")
        if not trainer.is_global_zero:
            return
        tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
        self.written = export(pl_module, root, tokenizer)
        rank_zero_info(f"export: {self.written} (load it with lightning_mrs.from_pretrained({str(self.written)!r}))")

