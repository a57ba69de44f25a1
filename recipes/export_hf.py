"""Export an LM recipe model as a Hugging Face directory that ``lightning_mrs.from_pretrained`` loads back.

At the end of every fit the LM recipe writes ``<run>/hf/`` (``--export``, :class:`recipes.text.export.ExportHF`): the
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
import sys
from typing import Optional

from recipes.common.errors import UsageError, report
from recipes.text.export import export, load_lm

__all__ = ["run"]


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
            from recipes.text.pretrained import load_tokenizer

            tokenizer = load_tokenizer(lm.hparams.pretrained)
        out = export(lm, args.out, tokenizer)
    except UsageError as err:
        return report(err)
    print(f"export: {out} (load it with lightning_mrs.from_pretrained({str(out)!r}))", file=sys.stderr)
    return 0
