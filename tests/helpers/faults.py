"""Faults injected into a recipe's fit, and a record of what each training step trained, for the resume tests.

:func:`inject` patches the recipe's LightningModule (and its ``ValidateAtEnd`` callback) so that

* every training step that finishes appends a line ``rank step batch_idx sha1(batch) seed`` to the
  file ``record`` (``seed``: ``torch.initial_seed()`` as the step ran, which the image recipe's
  ``StepSeed`` sets per batch);
* the fault ``kind`` happens once, at optimizer step ``at``: ``train_step_raises`` (``training_step``
  raises before its forward), ``sigint`` / ``sigterm`` (the signal reaches the process inside
  ``training_step``, as a Ctrl-C or a scheduler's SIGTERM would mid-step), ``validation_raises``
  (the first validation at or after step ``at`` raises), ``callback_raises`` (a callback's
  ``on_train_batch_end`` raises after step ``at``'s optimizer step).

Run as a script (``python tests/helpers/faults.py cifar100|lm ARGS``, with ``FAULT=kind@step`` and
``RECORD=path`` in the environment) it runs the recipe with the fault: Lightning's ``ddp`` launcher
re-runs this same command for the other ranks, so every process has the patches.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

KINDS = ("train_step_raises", "sigint", "sigterm", "validation_raises", "callback_raises")


def _digest(batch: Any) -> str:
    tensors = batch if isinstance(batch, (list, tuple)) else [batch]
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def inject(module_class: type, callback_class: type, kind: Optional[str], at: int, record: str,
           patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """Patch ``module_class`` (and ``callback_class.on_train_batch_end``) with ``patch(obj, name, value)``
    (``setattr``, or a pytest ``monkeypatch.setattr``) to record each step and fail as ``kind`` says."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"fault {kind!r}: choose one of {KINDS}")
    fired = [False]
    training_step, validation_step = module_class.training_step, module_class.validation_step
    on_train_batch_end = callback_class.on_train_batch_end

    def once(kind_here: str, now: bool) -> bool:
        if kind == kind_here and now and not fired[0]:
            fired[0] = True
            return True
        return False

    def recorded_training_step(self, batch, batch_idx):  # noqa: ANN001
        step = self.trainer.global_step
        if once("train_step_raises", step == at):
            raise RuntimeError(f"injected fault: training_step raised at step {step}")
        if once("sigint", step == at):
            os.kill(os.getpid(), signal.SIGINT)
        if once("sigterm", step == at):
            os.kill(os.getpid(), signal.SIGTERM)
        out = training_step(self, batch, batch_idx)
        with open(record, "a") as f:
            f.write(f"{self.trainer.global_rank} {step} {batch_idx} {_digest(batch)} {torch.initial_seed()}\n")
        return out

    def failing_validation_step(self, batch, batch_idx):  # noqa: ANN001
        if once("validation_raises", not self.trainer.sanity_checking and self.trainer.global_step >= at):
            raise RuntimeError(f"injected fault: validation raised at step {self.trainer.global_step}")
        return validation_step(self, batch, batch_idx)

    def failing_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx)
        if once("callback_raises", trainer.global_step == at + 1):
            raise RuntimeError(f"injected fault: a callback raised after step {at}")

    patch(module_class, "training_step", recorded_training_step)
    patch(module_class, "validation_step", failing_validation_step)
    patch(callback_class, "on_train_batch_end", failing_batch_end)


def read_record(path: Path) -> list[str]:
    """The recorded lines (``rank step batch_idx sha1 seed``), sorted by rank then in order; [] if none."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return sorted(lines, key=lambda line: int(line.split()[0]))  # stable: each rank's steps stay in order


def recipe(name: str) -> tuple[Callable[[Optional[list[str]]], int], type]:
    """The recipe's ``run`` and its LightningModule class."""
    if name == "cifar100":
        from recipes.cifar100 import ImageClassifier, run

        return run, ImageClassifier
    from recipes.lm import ByteLM, run

    return run, ByteLM


if __name__ == "__main__":
    import faulthandler

    faulthandler.register(signal.SIGUSR2)  # `kill -USR2 <pid>`: every thread's stack, when a test hangs
    root = Path(__file__).resolve().parents[2]
    sys.path[0:1] = [str(root), str(root / "tests")]  # not tests/helpers: its lightning.py would hide Lightning
    from recipes.common.training import ValidateAtEnd

    name, args = sys.argv[1], sys.argv[2:]
    run, module = recipe(name)
    fault = os.environ.get("FAULT")
    kind, at = fault.split("@") if fault else (None, "0")
    inject(module, ValidateAtEnd, kind, int(at), os.environ["RECORD"])
    sys.exit(run(args))  # sys.argv stays this script's: Lightning's launcher re-runs it for the other ranks


def last_checkpoint(root: Path, version: int) -> Path:
    """The ``last.ckpt`` of run ``version`` under a recipe's ``--trainer.default_root_dir`` ``root``."""
    return root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"
