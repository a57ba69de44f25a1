"""``LoggingStepMonitor``: the life cycle the monitors share, around their own statistics.

``GradientHomogeneityMonitor`` and ``AttentionMonitor`` capture on Lightning's logging steps
(:mod:`lightning_mrs.callbacks.logging_steps`) so that their figures appear where
``self.log``'s do. Around what each one watches and computes, they work alike, and this base
class is that common part:

* ``__init__`` validates ``log_every_n_steps`` and ``include`` (a regex on layer names);
* ``on_train_start`` sets the logging-step count (fresh, resumed, manual optimization) and
  warns when the interval exceeds the run; ``on_train_end`` warns when the run ended before
  its first logging step;
* ``on_train_batch_start`` of a logging batch opens a capture (:meth:`_open_capture`, on the
  layers :meth:`_discover` finds), after dropping one whose logging batch never ended;
* ``on_train_batch_end`` of the batch Lightning logs (the one that steps under automatic
  optimization, every batch under manual) closes it and hands it to :meth:`_finish`;
  an exception or teardown drops it;
* while a capture is open, compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``,
  :data:`~lightning_mrs.callbacks.capture.eager_while_capturing`): hooks registered on a model
  after ``torch.compile`` traced it are not called by compiled code, so the logging batch runs
  without compilation and the figures are those of the eager model (with an interval of 1 every
  batch is a logging batch, so a compiled model never runs compiled: warned once, at the start of
  training or after the first batch for a model compiled in its first step);
* :meth:`_publish` logs a metrics dict from rank zero through every logger and writes the
  monitor's TensorBoard dashboard once; warnings are given once per key (:meth:`_warn_once`);
* ``state_dict`` keeps ``n_logs`` and the logging-step count.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, Optional, Protocol, Sequence, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_mrs.callbacks.capture import eager_while_capturing
from lightning_mrs.callbacks.logging_steps import LoggingSteps
from lightning_mrs.callbacks.tb_layout import Dashboard, tensorboard_experiment

__all__ = ["LoggingStepMonitor", "StepCapture", "check_count", "check_fraction"]


class StepCapture(Protocol):
    """What the base class needs of a capture: its logging step, whether an optimizer stepped
    since it opened (the subclass sets it), and ``close()`` (remove its hooks; idempotent)."""

    step: int
    stepped: bool

    def close(self) -> None: ...


LayerT = TypeVar("LayerT")
CaptureT = TypeVar("CaptureT", bound=StepCapture)


def check_count(owner: str, name: str, value: Any, none: str = "") -> None:
    """Raise a ``ValueError`` naming ``owner`` unless ``value`` is ``None`` or an int >= 1
    (``none``: what ``None`` means, appended to the message)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{owner}: {name} must be None or an int >= 1{none}, got {value!r}.")


def check_fraction(owner: str, name: str, value: Any, meaning: str) -> None:
    """Raise a ``ValueError`` naming ``owner`` unless ``value`` is a number in ``(0, 1)``
    (``meaning``: what the value is, in the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{owner}: {name} must lie in (0, 1) ({meaning}), got {value!r}.")


class LoggingStepMonitor(Callback, ABC, Generic[LayerT, CaptureT]):
    """A callback that captures layers on Lightning's logging steps and logs what it saw.

    A subclass sets :attr:`owner` (its name, which starts every message) and :attr:`board`
    (its TensorBoard dashboard, whose prefix names its tags in warnings) and implements
    :meth:`_discover` (the layers to watch, warning about the others), :meth:`_open_capture`
    and :meth:`_finish` (figures of a closed capture, logged through :meth:`_publish`); it sets
    ``capture.stepped`` in ``on_before_optimizer_step``.

    Args:
        log_every_n_steps: capture on the batches Lightning logs at with this interval;
            ``None`` uses the Trainer's ``log_every_n_steps``.
        include: a regex; only layers whose name matches (``re.search``) are watched.
        dashboard: write the TensorBoard custom-scalars layout of :attr:`board`.

    Example:
        >>> from torch import nn
        >>> from lightning_mrs.callbacks.tb_layout import Dashboard
        >>> class Calls:  # one logging step's capture: forward calls of the watched layers
        ...     def __init__(self, layers, step):
        ...         self.step, self.stepped, self.count = step, False, 0
        ...         self.handles = [m.register_forward_hook(self.hook) for m in layers]
        ...     def hook(self, *args):
        ...         self.count += 1
        ...     def close(self):
        ...         for handle in self.handles:
        ...             handle.remove()
        >>> class LinearCalls(LoggingStepMonitor):
        ...     owner, board = "LinearCalls", Dashboard("Linear calls", "linear", ())
        ...     def _discover(self, pl_module):
        ...         return [m for m in pl_module.modules() if isinstance(m, nn.Linear)]
        ...     def _open_capture(self, layers, step, pl_module):
        ...         return Calls(layers, step)
        ...     def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ...         if self._capture is not None:
        ...             self._capture.stepped = True
        ...     def _finish(self, trainer, capture):
        ...         self._publish(trainer, {"linear/all/calls": float(capture.count)}, capture.step, [])
        >>> LinearCalls(log_every_n_steps=10).state_dict()
        {'n_logs': 0, 'batches': 0}
    """

    owner: ClassVar[str]
    board: ClassVar[Dashboard]

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

    @abstractmethod
    def _finish(self, trainer: pl.Trainer, capture: CaptureT) -> None:
        """Reduce a closed capture over ranks and log its figures (:meth:`_publish`)."""

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

    def _drop_capture(self) -> None:
        if self._capture is not None:
            capture, self._capture = self._capture, None
            self._close(capture)

    @staticmethod
    def _close(capture: StepCapture) -> None:
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

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = self._steps.current(trainer, pl_module)
        capture = self._capture
        if capture is not None and (LoggingSteps.manual(pl_module) or capture.step != step):
            self._drop_capture()  # a capture whose logging batch never ended: discard
        if self._capture is not None or not (
            LoggingSteps.is_logging_step(step, self._interval(trainer)) or trainer.should_stop
        ):
            return
        layers = self._discover(pl_module)
        if layers:
            self._capture = self._open_capture(layers, step, pl_module)
            eager_while_capturing.enter()  # hooks on a compiled model fire only in eager code

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        capture = self._capture
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
