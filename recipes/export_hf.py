"""Export an LM recipe model as a Hugging Face directory that ``lightning_mrs.from_pretrained`` loads back.

At the end of every fit the LM recipe writes ``<run>/hf/`` (``--export``, :class:`ExportHF`): the
model's ``save_pretrained`` (the norm swap recorded in ``config.json``, see
``docs/transformers.md#saving-and-loading-back``) and the tokenizer of ``--model.pretrained``
when there is one. From a checkpoint, a file or the directory of shards that FSDP2
(``--trainer.strategy fsdp2``) writes (consolidated here, in one process):

    python recipes/export_hf.py <run>/checkpoints/last.ckpt <out_dir>

Example:
    >>> import lightning_mrs
    >>> model = lightning_mrs.from_pretrained("<out_dir>")  # doctest: +SKIP
"""

from __future__ import annotations

if __name__ == "__main__":  # `python recipes/export_hf.py`: run this file as the module recipes.export_hf
    import os as _os
    import sys as _sys

    _sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))  # the repository root
    from recipes.export_hf import run

    _sys.exit(run())

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from recipes.errors import UsageError, report

__all__ = ["ExportHF", "export", "load_lm", "run"]


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
    from recipes.byte_lm import ByteLM

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


def run(argv: Optional[list[str]] = None) -> int:
    """``python recipes/export_hf.py CHECKPOINT OUT``: one error line (exit 2) for a bad checkpoint."""
    parser = argparse.ArgumentParser(prog="recipes/export_hf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a recipe checkpoint: a .ckpt file or FSDP2's directory of shards")
    parser.add_argument("out", help="the Hugging Face directory to write")
    args = parser.parse_args(argv)
    try:
        try:
            lm = load_lm(args.checkpoint)
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise UsageError(f"{args.checkpoint}: {err}") from None
        tokenizer = None
        if lm.hparams.get("pretrained"):
            from recipes.pretrained_lm import load_tokenizer

            tokenizer = load_tokenizer(lm.hparams.pretrained)
        out = export(lm, args.out, tokenizer)
    except UsageError as err:
        return report(err)
    print(f"export: {out} (load it with lightning_mrs.from_pretrained({str(out)!r}))", file=sys.stderr)
    return 0
