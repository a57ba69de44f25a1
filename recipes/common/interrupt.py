"""Nothing lost on Ctrl-C or a crash: a resumable checkpoint, where it is, and the command that resumes.

:class:`SaveOnInterrupt` makes the first Ctrl-C of a fit a request: the step running finishes (every
process of a multi-process run agrees on the same step), a checkpoint is written beside the run's
others (``<run>/checkpoints/last.ckpt``, at the step boundary, so resuming it gives the same
result as a run that was never interrupted) and the fit stops as Lightning stops on Ctrl-C (the
callbacks' ``on_exception``: the HParams record says ``ended: interrupted``). A second Ctrl-C
stops at once, without a checkpoint. A crash (any other exception) in a one-process run saves
``<run>/checkpoints/crash.ckpt`` when the model is at a step boundary (the failing step had not
yet changed any weight: the crash came in its first batch's forward or backward), and says
when it is not. The recipe then prints :meth:`SaveOnInterrupt.resume_hint` and
exits 130 (an interruption) or with the crash's usual failure (the error is raised again).

Example:
    >>> saver = SaveOnInterrupt()
    >>> saver.saved is None and not saver.requested
    True
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.fabric.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from recipes.common.errors import UsageError, report

__all__ = ["SaveOnInterrupt", "resume_command", "run_resumable"]


def resume_command(script: str, args: Sequence[str], ckpt_path: str) -> str:
    """The command line that resumes: ``args`` without their ``--ckpt_path``, then ``--ckpt_path ckpt_path``.

    Example:
        >>> resume_command("recipes/lm.py", ["--config", "a.yaml", "--ckpt_path", "old.ckpt"], "run/last.ckpt")
        'python recipes/lm.py --config a.yaml --ckpt_path run/last.ckpt'
    """
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join(["python", script, *kept, "--ckpt_path", ckpt_path])


class SaveOnInterrupt(Callback):
    """On Ctrl-C, finish the step, save a resumable checkpoint and stop; on a crash, save what is resumable.

    Attributes:
        requested: a Ctrl-C arrived (this process).
        saved: the checkpoint written on the interruption or crash (``None``: none).
        step: the optimizer step the checkpoint holds (or the run had reached).
        unsaved_reason: why a crash wrote no checkpoint.
    """

    def __init__(self) -> None:
        self.requested = False
        self.saved: Optional[str] = None
        self.step: Optional[int] = None
        self.unsaved_reason: Optional[str] = None
        self._previous: Any = None
        self._step_at_batch_start = 0
        self._batches_in_step = 0  # batches of the current optimizer step that have started
        self._stop = False  # saved: stop before the next batch or validation
        self._stepping = False  # between on_before_optimizer_step and the end of that batch

    # ------------------------------------------------------------------ the Ctrl-C request
    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
        print("\nCtrl-C: finishing this step, then saving a checkpoint to resume from (Ctrl-C again: stop at once, "
              "without it)", file=sys.stderr, flush=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.requested, self.saved, self.step, self.unsaved_reason = False, None, None, None
        self._batches_in_step, self._stop = 0, False
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _restore_handler(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handler()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._stop_now()
        self._step_at_batch_start = trainer.global_step
        self._batches_in_step += 1

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._stepping = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stepping = False
        if trainer.global_step == self._step_at_batch_start:
            return  # inside a gradient accumulation: the step boundary comes later
        self._batches_in_step = 0
        stop = self.requested
        if trainer.world_size > 1:  # every process stops after the same step
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop or 0 < trainer.max_steps <= trainer.global_step:
            return  # no request, or the run's last step: it ends (validates, checkpoints) as it would have
        # saved where ModelCheckpoint(every_n_train_steps=...) saves, which Lightning resumes exactly; the
        # fit stops once the step's own logging is done, before anything of the next step runs
        self.saved, self.step = self.path(trainer, "last.ckpt"), trainer.global_step
        trainer.save_checkpoint(self.saved)
        self._stop = True

    def _stop_now(self) -> None:
        if self._stop:
            self._stop = False
            raise KeyboardInterrupt  # Lightning's own Ctrl-C shutdown: on_exception hooks, loggers finalized

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_now()

    # ------------------------------------------------------------------ a crash
    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_handler()
        if self.saved is not None or trainer.state.fn != "fit":
            return
        self.step = trainer.global_step
        if isinstance(exception, KeyboardInterrupt):
            self.unsaved_reason = "stopped at once (a second Ctrl-C, or one outside a training step)"
            return
        if trainer.world_size > 1:  # the other processes are not there to save with this one
            self.unsaved_reason = "a multi-process run cannot save once one process has failed"
        elif self._batches_in_step > 1:
            self.unsaved_reason = ("the failure came in the middle of a gradient accumulation, whose "
                                   "first batches' gradients are lost")
        elif self._stepping:
            self.unsaved_reason = "the failure came during or after the optimizer's step, before the step ended"
        else:
            self.saved = self.path(trainer, "crash.ckpt")
            trainer.save_checkpoint(self.saved)

    @staticmethod
    def path(trainer: pl.Trainer, name: str) -> str:
        """``name`` in the directory of the run's checkpoints (``<run>/checkpoints``)."""
        callback = trainer.checkpoint_callback
        directory = getattr(callback, "dirpath", None)
        if not directory:
            directory = os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")
        return os.path.join(directory, name)

    def resume_hint(self, script: str, args: Sequence[str], *, last: Optional[str] = None) -> str:
        """What was saved and the command that resumes (``last``: the newest validation checkpoint, if any)."""
        if self.saved is not None:
            what = "interrupted" if os.path.basename(self.saved) == "last.ckpt" else "failed"
            return (f"{what} after step {self.step}: saved {self.saved}; resume with\n  "
                    f"{resume_command(script, args, self.saved)}")
        reason = f" ({self.unsaved_reason})" if self.unsaved_reason else ""
        where = (f"; the last checkpoint is {last}; resume with\n  {resume_command(script, args, last)}"
                 if last else "; no checkpoint was written yet")
        at = f" at step {self.step}" if self.step is not None else ""
        return f"stopped{at} without a checkpoint{reason}{where}"


def _saver(cli: Any) -> Optional[SaveOnInterrupt]:
    trainer = getattr(cli, "trainer", None)
    return next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, SaveOnInterrupt)), None)


def _hint(cli: Any, saver: SaveOnInterrupt, script: str, argv: list[str]) -> None:
    if cli.trainer.is_global_zero:
        last = getattr(cli.trainer.checkpoint_callback, "last_model_path", None) or None
        print(saver.resume_hint(script, argv, last=last), file=sys.stderr, flush=True)


def run_resumable(build_cli: Callable[[Optional[list[str]]], Any], script: str,
                  args: Optional[list[str]] = None) -> int:
    """Build a recipe's CLI (its trainer holding a :class:`SaveOnInterrupt`) and fit: user errors as one
    stderr line (exit 2), Ctrl-C as a resumable interruption, the checkpoint saved and the command that
    resumes printed (exit 130); a crash says what it saved and fails. ``script``: the recipe's path as
    the resume command gives it (``recipes/lm.py``)."""
    argv = list(sys.argv[1:] if args is None else args)
    cli: Any = None
    on_sigint = signal.getsignal(signal.SIGINT)
    try:
        cli = build_cli(args)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))
    except (UsageError, MisconfigurationException) as err:
        return report(err)
    except (KeyboardInterrupt, SystemExit) as err:
        saver = _saver(cli)
        if isinstance(err, SystemExit) and saver is None:
            raise  # --help, --print_config: not an interruption
        signal.signal(signal.SIGINT, on_sigint)  # Lightning ignores Ctrl-C after its shutdown
        if saver is None:
            print("\ninterrupted before training started: nothing to resume.", file=sys.stderr)
        else:
            _hint(cli, saver, script, argv)
        return 130
    except Exception:
        saver = _saver(cli)
        if saver is not None and (saver.saved or saver.unsaved_reason):
            _hint(cli, saver, script, argv)
        raise
    return 0
