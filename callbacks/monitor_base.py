"""``LoggingStepMonitor``: the life cycle the monitors share, around their own statistics.

``GradientHomogeneityMonitor``, ``AttentionMonitor`` and ``OutlierMonitor`` capture on Lightning's logging steps
(:mod:`lightning_mrs.callbacks.logging_steps`) so that their figures appear where
``self.log``'s do. Around what each one watches and computes, they work alike, and this base
class is that common part:

* ``__init__`` validates ``log_every_n_steps`` and ``include`` (a regex on layer names);
* ``on_train_start`` sets the logging-step count (fresh, resumed, manual optimization) and
  warns when the interval exceeds the run; ``on_train_end`` warns when the run ended before
  its first logging step;
* ``on_train_batch_start`` of a logging batch opens a capture (:meth:`_open_capture`, on the
  layers :meth:`_discover` finds), after dropping one whose logging batch never ended, and arms
  it (every micro-batch of the logging step);
* a :attr:`~LoggingStepMonitor.forward_only` monitor (what enters or leaves modules in the
  forward) finds its layers at ``on_train_start`` (its warnings come then) and disarms its
  capture as soon as the training forward is over (``on_before_backward``, at the latest
  ``on_train_batch_end``), so that backward recomputation (activation checkpointing) and
  validation are never captured;
* ``on_train_batch_end`` of the batch Lightning logs (the one that steps under automatic
  optimization, every batch under manual) closes it and hands it to :meth:`_finish`;
  an exception or teardown drops it;
* while a capture is open, compiled code runs eagerly
  (:data:`~lightning_mrs.callbacks.capture.eager_while_capturing` says why; an interval of 1 is
  warned about once, :meth:`~LoggingStepMonitor._warn_always_eager`);
* :meth:`_finish` reduces a closed capture and logs its figures, :meth:`_publish` through every
  logger; warnings are given once per key, those about the layers found in one wording (:meth:`_found`);
* ``state_dict`` keeps ``n_logs`` and the logging-step count.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from functools import partial
from typing import Any, ClassVar, Generic, Mapping, Optional, Sequence, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_mrs.callbacks.capture import LayerCapture, LayerT, eager_while_capturing, layer_metrics, reduce_over_ranks
from lightning_mrs.callbacks.logging_steps import LoggingSteps
from lightning_mrs.callbacks.tb_layout import Dashboard, tensorboard_experiment
from lightning_mrs.sums import Figure

__all__ = ["LoggingStepMonitor", "check_count", "check_fraction"]

CaptureT = TypeVar("CaptureT", bound=LayerCapture)


def check_count(owner: str, name: str, value: Any, note: str = "", minimum: int = 1, none: bool = True) -> None:
    """Raise a ``ValueError`` naming ``owner`` unless ``value`` is an int >= ``minimum`` (or, with
    ``none``, ``None``); ``note`` (what ``None`` or the minimum means) is appended to the message."""
    if (value is not None or not none) and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{owner}: {name} must be {'None or ' * none}an int >= {minimum}{note}, got {value!r}.")


def check_fraction(owner: str, name: str, value: Any, meaning: str) -> None:
    """Raise a ``ValueError`` naming ``owner`` unless ``value`` is a number in ``(0, 1)``
    (``meaning``: what the value is, in the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{owner}: {name} must lie in (0, 1) ({meaning}), got {value!r}.")


class LoggingStepMonitor(Callback, ABC, Generic[LayerT, CaptureT]):
    """A callback that captures layers on Lightning's logging steps and logs what it saw.

    A subclass sets :attr:`owner` (its name, which starts every message), :attr:`board` (its
    TensorBoard dashboard, whose prefix names its tags in warnings), :attr:`figures_table` and
    :attr:`seen` (what it logs, see :meth:`_finish`) and :attr:`forward_only`, and implements
    :meth:`_discover` (the layers to watch, reported through :meth:`_found`) and
    :meth:`_open_capture`. ``docs/monitors.md#writing-your-own-monitor`` has a complete example.

    Args:
        log_every_n_steps: capture on the batches Lightning logs at with this interval;
            ``None`` uses the Trainer's ``log_every_n_steps``.
        include: a regex; only layers whose name matches (``re.search``) are watched.
        dashboard: write the TensorBoard custom-scalars layout of :attr:`board`.
    """

    owner: ClassVar[str]
    board: ClassVar[Dashboard]
    #: figure name -> formula and pooling over layers, logged by :meth:`_finish` (an instance may narrow it)
    figures_table: Mapping[str, Figure] = {}
    #: the count field of the sums that says a layer was called on the step (else it is not logged)
    seen: ClassVar[str] = ""
    #: the hooks watch the training forward only (disarmed before backward)
    forward_only: ClassVar[bool] = False

    def __init__(self, log_every_n_steps: Optional[int] = None, *, include: Optional[str] = None,
                 dashboard: bool = True) -> None:
        super().__init__()
        check_count(self.owner, "log_every_n_steps", log_every_n_steps, " (None: use the Trainer's)")
        try:
            self._include = re.compile(include) if include is not None else None
        except re.error as err:
            raise ValueError(f"{self.owner}: include={include!r} is not a valid regex: {err}.") from err
        self.log_every_n_steps = log_every_n_steps
        self.include = include
        self.dashboard = dashboard
        self._n_logs = 0  # persistent (state_dict), with the steps' count
        self._steps = LoggingSteps(self.owner, f"{self.board.prefix}/*")
        # per-fit / per-capture state
        self._capture: Optional[CaptureT] = None
        self._start_step = 0
        self._layout_written = False
        self._warned: set[str] = set()
        self._compile_checked = False  # a model compiled in its first training step is seen after it

    # ------------------------------------------------------------------ what a subclass adds
    @abstractmethod
    def _discover(self, pl_module: pl.LightningModule) -> list[LayerT]:
        """The layers to watch (those :meth:`_included`); warns (once) about the others."""

    @abstractmethod
    def _open_capture(self, layers: list[LayerT], step: int, pl_module: pl.LightningModule) -> CaptureT:
        """A capture of ``layers`` for logging step ``step``."""

    def _finish(self, trainer: pl.Trainer, capture: CaptureT) -> None:
        """Reduce a closed capture over ranks and log the figures of :attr:`figures_table`."""
        sums = capture.reduced(partial(reduce_over_ranks, trainer.strategy))
        metrics = layer_metrics(self.board.tag, capture.layers, sums, self.figures_table, self.seen,
                                self._figures_of, self.per_layer)
        self._publish(trainer, metrics, capture.step, [layer.name for layer in capture.layers])

    def _figures_of(self, layer: LayerT) -> Sequence[str]:
        """The figures of :attr:`figures_table` logged for ``layer`` (default: all)."""
        return tuple(self.figures_table)

    per_layer = True  # log z-layers/<prefix>/<layer>/* (else <prefix>/all/* only)

    # ------------------------------------------------------------------ helpers
    @property
    def state_key(self) -> str:
        return self._generate_state_key(log_every_n_steps=self.log_every_n_steps, include=self.include)

    @property
    def n_logs(self) -> int:
        """Logging steps whose figures were computed so far (over resumes)."""
        return self._n_logs

    def _included(self, name: str) -> bool:
        """Whether the layer named ``name`` matches ``include``."""
        return self._include is None or self._include.search(name) is not None

    def _interval(self, trainer: pl.Trainer) -> int:
        return self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def _found(self, layers: list[LayerT], skipped: Sequence[str], kind: str, which: str) -> list[LayerT]:
        """``layers``, after warning (once) about the ``skipped`` ones (``"name (Class: reason)"``) and
        when there is none: ``kind`` is what is watched (``"norm layer"``), ``which`` says which can be."""
        if skipped:
            self._warn_once("skipped:" + ";".join(skipped),
                            f"{self.owner}: not monitoring these {kind}s: " + "; ".join(skipped) + ".")
        if not layers:
            self._warn_once("nolayers", f"{self.owner}: the model has no {kind} it can monitor ({which}); "
                            "nothing will be logged.")
        return layers

    def _drop_capture(self) -> None:
        if self._capture is not None:
            capture, self._capture = self._capture, None
            self._close(capture)

    @staticmethod
    def _close(capture: LayerCapture) -> None:
        """Close a capture: its hooks removed, compiled code compiled again (:data:`eager_while_capturing`)."""
        try:
            capture.close()
        finally:
            eager_while_capturing.exit()

    def _warn_always_eager(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Warn (once) when every step is a logging step, so a compiled model runs eagerly throughout."""
        interval = self._interval(trainer)
        if interval == 1 and _compiled(pl_module):
            where = (f"{self.owner}(log_every_n_steps=1)" if self.log_every_n_steps is not None
                     else "Trainer(log_every_n_steps=1)")
            self._warn_once("compiled", (
                f"{self.owner}: with {where} every training step is a logging step, and a logging step runs the model "
                "eagerly (torch.compiler.set_stance('force_eager'), so that the monitor's hooks fire): the "
                f"torch.compile'd model never runs compiled in this run. Pass {self.owner}(log_every_n_steps=N) with "
                "N > 1 (e.g. 50): the other steps then run compiled."
            ))

    def _warn_interval(self, trainer: pl.Trainer, end: float, ended: bool) -> None:
        """Warn (once) when no logging step lies in ``[start, end)``."""
        if trainer.loggers:
            message = self._steps.no_logging_step(self._start_step, end, self._interval(trainer), ended)
            if message is not None:
                self._warn_once("interval", message)

    def _publish(self, trainer: pl.Trainer, metrics: dict[str, float], step: int, layers: Sequence[str]) -> list[Any]:
        """Log ``metrics`` at ``step`` from rank zero through every logger and write the dashboard
        (for the layer names ``layers``) once.

        Returns:
            The TensorBoard ``SummaryWriter`` of each TensorBoard logger (none off rank zero or
            without metrics).
        """
        if not trainer.is_global_zero or not metrics:
            return []
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        experiments = [e for e in map(tensorboard_experiment, trainer.loggers) if e is not None]
        if self.dashboard and not self._layout_written:
            self._layout_written = any([self.board.write(e, layers) for e in experiments])
        return experiments

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guessed = self._steps.start(trainer, pl_module)
        if guessed is not None:
            self._warn_once("resume", guessed)
        self._start_step = self._steps.current(trainer, pl_module)
        self._warn_interval(trainer, LoggingSteps.run_length(trainer), ended=False)
        self._compile_checked = False
        self._warn_always_eager(trainer, pl_module)
        if self.forward_only:
            self._discover(pl_module)  # warnings now, not at the first logging step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = self._steps.current(trainer, pl_module)
        capture = self._capture
        if capture is not None and (LoggingSteps.manual(pl_module) or capture.step != step):
            self._drop_capture()  # a capture whose logging batch never ended: discard
        if self._capture is None and (LoggingSteps.is_logging_step(step, self._interval(trainer)) or trainer.should_stop):
            layers = self._discover(pl_module)
            if layers:
                self._capture = self._open_capture(layers, step, pl_module)
                eager_while_capturing.enter()  # hooks on a compiled model fire only in eager code
        if self._capture is not None:
            self._capture.arm()  # every micro-batch of the logging step

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.forward_only and self._capture is not None:
            self._capture.disarm()  # the training forward is over

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._capture is not None:
            self._capture.stepped = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        capture = self._capture
        if self.forward_only and capture is not None:
            capture.disarm()  # at the latest; the next micro-batch of a logging step re-arms it
        try:
            # automatic optimization logs the batch that steps; manual logs every batch
            if capture is not None and (capture.stepped or LoggingSteps.manual(pl_module)):
                self._capture = None
                self._close(capture)  # no hook may fire during the collective / logging
                try:
                    self._finish(trainer, capture)
                finally:
                    self._n_logs += 1
        finally:
            self._steps.batch_done(pl_module)
            if not self._compile_checked:  # a model compiled inside its first training_step
                self._compile_checked = True
                self._warn_always_eager(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drop_capture()
        self._warn_interval(trainer, self._steps.current(trainer, pl_module), ended=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._drop_capture()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._drop_capture()

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"n_logs": self._n_logs, **self._steps.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._n_logs = int(state_dict.get("n_logs", 0))
        self._steps.load_state_dict(state_dict)


def _compiled(pl_module: pl.LightningModule) -> bool:
    """``pl_module`` or one of its submodules is ``torch.compile``'d (``trainer.fit(torch.compile(model))``
    leaves Lightning's ``_compiler_ctx`` on the unwrapped module)."""
    from torch._dynamo import OptimizedModule  # Lightning imports it already

    return getattr(pl_module, "_compiler_ctx", None) is not None or any(
        isinstance(m, OptimizedModule) for m in pl_module.modules())
