"""Nothing lost on Ctrl-C, SIGTERM or a crash, through Lightning's own mechanisms, and the command that resumes.

:class:`SaveOnInterrupt` makes the first Ctrl-C or SIGTERM of a fit a request: the step running finishes, every process of a
multi-process run agrees on the same step, and the fit stops before the next batch as Lightning
stops on Ctrl-C (``KeyboardInterrupt``) or SIGTERM (``SIGTERMException``); a second Ctrl-C stops
at once. On any exception it does what Lightning's ``OnExceptionCheckpoint`` does
(``trainer.save_checkpoint``), beside the run's other checkpoints (``last.ckpt`` after a stop,
``crash.ckpt`` after a failure), when the checkpoint resumes as the uninterrupted run: a batch
fetched but not trained (``training_step`` raised, or the stop came before it) is given back to
the stateful training loader first, since Lightning's own counters roll that batch back on resume;
nothing is saved, and the reason is said, in the middle of a gradient accumulation, during the
optimizer's step, or when one process of several failed. :func:`run_resumable` then prints
:meth:`SaveOnInterrupt.resume_hint` and exits 130 (Ctrl-C), 143 (SIGTERM) or with the crash's usual
failure (the error raised again).

Not an ``OnExceptionCheckpoint``: a trainer holding one turns ``fit(ckpt_path=None)`` into
``ckpt_path="last"`` (Lightning's ``_parse_ckpt_path``), so a new run would silently start from the
newest ``last.ckpt`` it finds. Not Lightning's SIGTERM handler during training: it calls
``dist.broadcast`` inside the handler, so a multi-process run whose processes all get the signal
(as SLURM and torchrun send it) deadlocks; Lightning alone also stops a one-process run only at the
epoch's end.

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
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from recipes.common.errors import UsageError, report

__all__ = ["SaveOnInterrupt", "last_checkpoint", "resume_callbacks", "resume_command", "run_resumable"]

STOPS = (KeyboardInterrupt, SIGTERMException)


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
    """On Ctrl-C or SIGTERM, finish the step, save a resumable checkpoint and stop; on a crash, save what resumes.

    Attributes:
        requested: a Ctrl-C arrived (this process).
        exception: the exception that ended the fit (``None``: none).
        saved: the checkpoint written on it (``None``: none).
        step: the optimizer step the checkpoint holds (or the run had reached).
        unsaved_reason: why nothing was written.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._position: Any = None  # the training loader's state after the last batch trained
        self._step_at_batch_start = 0
        self._reset(training=False)

    def _reset(self, training: bool) -> None:
        """The state of a fit that has not been stopped (``training``: between on_train_start and on_train_end)."""
        self.requested = False
        self.sigterm = False
        self.exception: Optional[BaseException] = None
        self.saved: Optional[str] = None
        self.step: Optional[int] = None
        self.unsaved_reason: Optional[str] = None
        self._training = training  # a state to save
        self._stop: Optional[BaseException] = None  # raised before the next batch or validation
        self._raised: Optional[BaseException] = None  # the stop raised (a second Ctrl-C is another exception)
        self._pending = 0  # batches trained since the last optimizer step (their gradients are in no checkpoint)
        self._stepping = False  # this batch's optimizer step has begun

    # ------------------------------------------------------------------ Ctrl-C and SIGTERM: a request
    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once
        print("\nCtrl-C: finishing this step, then saving a checkpoint to resume from (Ctrl-C again: stop at once, "
              "without it)", file=sys.stderr, flush=True)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # instead of Lightning's handler during training: it broadcasts inside the handler, which deadlocks a
        # multi-process run whose every process gets the signal (SLURM, torchrun; tests/recipes/test_resume_faults.py)
        self.sigterm = True
        print("\nSIGTERM: finishing this step, then saving a checkpoint to resume from", file=sys.stderr, flush=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset(training=True)
        self._remember_position(trainer)
        if threading.current_thread() is threading.main_thread():
            self._previous = {signal.SIGINT: signal.signal(signal.SIGINT, self._on_sigint),
                              signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_sigterm)}

    def _restore_handler(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            self._previous = {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._training = False
        self._restore_handler()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remember_position(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._stop_now()
        self._step_at_batch_start, self._stepping = trainer.global_step, False

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._stepping = True

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stepping = False
        if trainer.global_step == self._step_at_batch_start:
            self._pending += 1
            return  # inside a gradient accumulation: the step boundary comes later (no position to keep before it)
        self._pending = 0
        self._remember_position(trainer)
        stop = 2 if self.requested else int(self.sigterm or bool(trainer.received_sigterm))  # Ctrl-C, SIGTERM, none
        if trainer.world_size > 1:  # every process stops after the same step, for the same reason: one collective
            code = torch.tensor(stop, device=trainer.strategy.root_device)
            stop = int(trainer.strategy.reduce(code, reduce_op="max"))
        if stop and not 0 < trainer.max_steps <= trainer.global_step:  # the last step ends as usual
            # raised once this step's own logging is done, before anything of the next step trains
            self._stop = KeyboardInterrupt() if stop == 2 else SIGTERMException()

    def _stop_now(self) -> None:
        if self._stop is not None:
            self._raised, self._stop = self._stop, None
            raise self._raised

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_now()

    def _remember_position(self, trainer: pl.Trainer) -> None:
        loader = trainer.train_dataloader
        self._position = loader.state_dict() if hasattr(loader, "load_state_dict") else None

    # ------------------------------------------------------------------ the checkpoint on an exception
    def _unresumable(self, trainer: pl.Trainer, exception: BaseException, trained: bool) -> Optional[str]:
        if isinstance(exception, KeyboardInterrupt) and exception is not self._raised:
            return "stopped at once (a second Ctrl-C, or one outside a training step)"
        if trainer.world_size > 1 and not isinstance(exception, STOPS):  # the others may wait in a collective
            return "a multi-process run cannot save once one process has failed"
        if self._pending or (trained and trainer.global_step == self._step_at_batch_start):
            return "the failure came in the middle of a gradient accumulation, whose first batches' gradients are lost"
        if self._stepping and not trained:
            return "the failure came during the optimizer's step, before the step ended"
        return None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_handler()
        self.exception = exception
        if not self._training or self.saved is not None or trainer.sanity_checking:
            return  # before training (nothing to resume) or after it (its own checkpoints are there)
        self.step = trainer.global_step
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        trained = progress.processed > progress.completed  # Lightning counts this batch as done on resume
        self.unsaved_reason = self._unresumable(trainer, exception, trained)
        if self.unsaved_reason is not None:
            return
        if not trained and self._position is not None:
            # a batch fetched, not trained: Lightning rolls its counters back to the last batch trained, so
            # the loader goes back there too (the resumed run trains that batch, as the uninterrupted one did)
            trainer.train_dataloader.load_state_dict(self._position)
        path = os.path.join(checkpoint_dir(trainer), "last.ckpt" if isinstance(exception, STOPS) else "crash.ckpt")
        try:
            trainer.save_checkpoint(path)
        except Exception as err:  # the run's own error stays the one raised
            self.unsaved_reason = f"writing {path} failed: {type(err).__name__}: {err}"
            return
        self.saved = path

    def resume_hint(self, script: str, args: Sequence[str], *, last: Optional[str] = None) -> str:
        """What was saved and the command that resumes (``last``: the newest ``last.ckpt``, if any)."""
        if self.saved is not None:
            what = {KeyboardInterrupt: "interrupted", SIGTERMException: "stopped by SIGTERM"}.get(
                type(self.exception), "failed")
            return (f"{what} after step {self.step}: saved {self.saved}; resume with\n  "
                    f"{resume_command(script, args, self.saved)}")
        reason = f" ({self.unsaved_reason})" if self.unsaved_reason else ""
        where = (f"; the last checkpoint is {last}; resume with\n  {resume_command(script, args, last)}"
                 if last else "; no checkpoint was written yet")
        at = f" at step {self.step}" if self.step is not None else ""
        return f"stopped{at} without a checkpoint{reason}{where}"


def resume_callbacks() -> list[Callback]:
    """A recipe's resume: ``last.ckpt`` at every validation (Lightning's ``ModelCheckpoint`` keeping the latest,
    ``monitor=None``; the best's ``save_last`` is rewritten in 2.6 only with a new best) and
    :class:`SaveOnInterrupt`."""
    return [ModelCheckpoint(filename="last", monitor=None, save_top_k=1, enable_version_counter=False),
            SaveOnInterrupt()]


def last_checkpoint(trainer: pl.Trainer) -> Optional[str]:
    """The newest ``last.ckpt`` the run's ``ModelCheckpoint`` callbacks wrote (``None``: none yet)."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            for path in (callback.last_model_path, callback.best_model_path if callback.monitor is None else ""):
                if path and os.path.basename(path) == "last.ckpt" and os.path.isfile(path):
                    return path
    return None


def checkpoint_dir(trainer: pl.Trainer) -> str:
    """The directory of the run's checkpoints (``<run>/checkpoints``)."""
    directory = getattr(trainer.checkpoint_callback, "dirpath", None)
    return directory or os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")


def _saver(cli: Any) -> Optional[SaveOnInterrupt]:
    trainer = getattr(cli, "trainer", None)
    return next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, SaveOnInterrupt)), None)


def _hint(cli: Any, saver: SaveOnInterrupt, script: str, argv: list[str]) -> None:
    if cli.trainer.is_global_zero:
        print(saver.resume_hint(script, argv, last=last_checkpoint(cli.trainer)), file=sys.stderr, flush=True)


def run_resumable(build_cli: Callable[[Optional[list[str]]], Any], script: str,
                  args: Optional[list[str]] = None) -> int:
    """Build a recipe's CLI (its trainer holding a :class:`SaveOnInterrupt`) and fit: user errors as one stderr
    line (exit 2); Ctrl-C and SIGTERM as a resumable stop, the checkpoint saved and the command that resumes
    printed (exit 130, 143); a crash says what it saved and fails. ``script``: the recipe's path as the resume
    command gives it (``recipes/lm.py``)."""
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
        if isinstance(err, SystemExit) and (saver is None or saver.exception is None):
            raise  # --help, --print_config: not an interruption
        signal.signal(signal.SIGINT, on_sigint)  # Lightning ignores Ctrl-C after its shutdown
        if saver is None:
            print("\ninterrupted before training started: nothing to resume.", file=sys.stderr)
            return 130
        _hint(cli, saver, script, argv)
        return 143 if isinstance(saver.exception, SIGTERMException) else 130  # 128 + the signal, as a shell says
    except Exception:
        saver = _saver(cli)
        if saver is not None and (saver.saved or saver.unsaved_reason):
            _hint(cli, saver, script, argv)
        raise
    return 0
