"""A run's hyperparameters and final metrics in TensorBoard's HParams dashboard (and every other logger).

TensorBoard lists a run in its HParams dashboard (table, parallel coordinates, scatter matrix) when
its event files hold an HParams *session*: the hyperparameters and the names of the metrics, whose
values it reads as the last point of those scalar tags in the same run. :func:`log_hparams` writes
one such session with the metrics' values, at the end of a run; :class:`HParamsSummary` is the
callback that does it when ``fit`` ends, with final metrics reduced from what the run logged
(the last ``val/top1``, its maximum, the mean ``phasor/all/grad_cv`` ...). A fit stopped by Ctrl-C
or an error still gets its session, with what it measured up to then, the hyperparameter
``ended`` ("interrupted": Ctrl-C or SIGTERM, "failed: <error>"; "completed" otherwise) and the session's status
"failure" in the dashboard.

The final metrics are tagged ``z-final/<name>`` (:data:`FINAL`): TensorBoard's Time Series orders
its tag groups by name, so ``z-final`` comes after ``train/*`` and ``val/*`` (the single points of
a run's summary are read in the HParams dashboard, not as curves). Loggers other than TensorBoard
get the same through ``log_hyperparams(params)`` and ``log_metrics(metrics, step)``.

Use it in a recipe (the classifier's :data:`CLASSIFIER_SUMMARY`; a language model names its own)::

    trainer = pl.Trainer(logger=TensorBoardLogger(".", default_hp_metric=False),
                         callbacks=[HParamsSummary(CLASSIFIER_SUMMARY, extra={"dataset": "digits"})])

or, after a run whose final metrics are computed by hand (the stress cells)::

    log_hparams(trainer.loggers, {"norm": "mrs", "lr": 0.1}, {"z-final/top1": 0.93}, step=trainer.global_step)

Give ``TensorBoardLogger(default_hp_metric=False)`` (or :class:`RunLogger`): Lightning's default writes
an empty ``hp_metric`` session at the start of every run.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, Optional, Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from recipes.common.interrupt import STOPS

__all__ = ["CLASSIFIER_SUMMARY", "FINAL", "REDUCTIONS", "HParamsSummary", "RunLogger", "StepCSVLogger",
           "flatten_params", "log_hparams"]

#: the tag group of the final metrics (sorts after ``val`` in TensorBoard's Time Series)
FINAL = "z-final"
#: how a logged series becomes one final number
REDUCTIONS = ("last", "max", "min", "mean", "nonfinite")

#: the image classifier's final metrics: name -> (logged tag, reduction). ``nonfinite``: 1.0 when
#: any logged value was NaN/Inf (the run diverged), else 0.0. Metrics whose tag was never logged
#: (no attention layers: no logit) are left out of the run's values, not of the table's columns.
CLASSIFIER_SUMMARY: dict[str, tuple[str, str]] = {
    f"{FINAL}/top1": ("val/top1", "last"),
    f"{FINAL}/best_top1": ("val/top1", "max"),
    f"{FINAL}/val_loss": ("val/loss", "last"),
    f"{FINAL}/train_loss": ("train/loss", "last"),
    f"{FINAL}/diverged": ("train/loss", "nonfinite"),
    f"{FINAL}/mean_grad_cv": ("phasor/all/grad_cv", "mean"),
    f"{FINAL}/mean_starved_frac": ("phasor/all/starved_frac", "mean"),
    f"{FINAL}/max_logit": ("attention/all/logit_max", "max"),
}


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``a/b`` keys; numbers and strings kept, anything else (a bool, ``None``, a tuple)
    as its ``str`` (torch would log a bool as 1.0; a string column filters by value); private keys
    (``_instantiator``) left out.

    Example:
        >>> flatten_params({"lr": 0.1, "arch_kwargs": {"depth": 4}, "betas": (0.9, 0.99), "root": None,
        ...                 "augment": True})
        {'lr': 0.1, 'arch_kwargs/depth': 4, 'betas': '(0.9, 0.99)', 'root': 'None', 'augment': 'True'}
    """
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if str(key).startswith("_"):
            continue
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, f"{name}/") if value else {name: "{}"})
        elif isinstance(value, (int, float, str)) and not isinstance(value, bool):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


@rank_zero_only
def _session_end(status: str) -> Any:
    """The HParams session-end summary with ``status`` ("success" or "failure")."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import metadata
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

    end = SessionEndInfo(status=Status.Value(f"STATUS_{status.upper()}"))
    content = HParamsPluginData(session_end_info=end, version=metadata.PLUGIN_DATA_VERSION)
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME,
                                                                  content=content.SerializeToString()))
    return Summary(value=[Summary.Value(tag=metadata.SESSION_END_INFO_TAG, metadata=meta)])


def log_hparams(loggers: Iterable[Logger], params: Mapping[str, Any], metrics: Mapping[str, Optional[float]], *,
                step: int = 0, metric_names: Optional[Sequence[str]] = None, status: str = "success") -> None:
    """Log ``params`` and the final ``metrics`` of a run through every logger; for TensorBoard, as an HParams
    session of the run (the HParams dashboard lists it).

    Args:
        loggers: e.g. ``trainer.loggers``; loggers already finalized are fine.
        params: the hyperparameters (nested mappings are flattened, see :func:`flatten_params`).
        metrics: metric tag -> value; ``None`` values are not logged (not measured in this run).
        step: the step of the metrics' points (the run's last step).
        metric_names: the HParams table's metric columns (default: ``metrics``' keys). Runs of one
            sweep should name the same columns: TensorBoard takes them from one run of the log dir.
        status: the session's status in TensorBoard: "success", or "failure" (an interrupted or
            failed run).
    """
    if status not in ("success", "failure"):
        raise ValueError(f"log_hparams: status must be 'success' or 'failure', got {status!r}.")
    from torch.utils.tensorboard.summary import hparams, scalar
    from torch.utils.tensorboard.writer import FileWriter

    flat = flatten_params(params)
    names = list(metric_names if metric_names is not None else metrics)
    values = {k: float(v) for k, v in metrics.items() if v is not None}
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            # a file of its own in the run's directory: the logger's writer may be closed already
            writer = FileWriter(logger.log_dir, filename_suffix=".hparams")
            try:
                for name, value in values.items():
                    writer.add_summary(scalar(name, value), step)
                experiment, start, _ = hparams(flat, {name: 0.0 for name in names})  # only the names are used
                for summary in (experiment, start, _session_end(status)):
                    writer.add_summary(summary, step)
            finally:
                writer.close()
        else:
            logger.log_hyperparams(flat)
            if values:
                logger.log_metrics(values, step=step)


class RunLogger(TensorBoardLogger):
    """The recipes' ``TensorBoardLogger``: no empty ``hp_metric`` (:func:`log_hparams` writes the real
    session), and the epoch counter Lightning adds to every ``self.log`` as ``train/epoch`` (beside
    ``train/*`` in the Time Series, not a group of its own above them), or not at all with
    ``epochs=False`` (a run on an endless stream, whose epoch is always 0). Other arguments as
    ``TensorBoardLogger``'s.

    Example:
        >>> RunLogger("runs", name="demo").name
        'demo'
    """

    def __init__(self, save_dir: Any, *args: Any, default_hp_metric: bool = False, epochs: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(save_dir, *args, default_hp_metric=default_hp_metric, **kwargs)
        self.epochs = epochs

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        if "epoch" in metrics:
            metrics = {"train/epoch" if k == "epoch" else k: v for k, v in metrics.items()
                       if k != "epoch" or self.epochs}
        super().log_metrics(metrics, step)


class StepCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` with one row per logged step: what the monitors, the learning-rate
    monitor, ``self.log`` and the validation log at one step arrives in separate calls, which
    ``CSVLogger`` writes as separate rows; here they are merged into one, written once the next step's
    figures arrive (or the run ends: ``finalize``). Arguments as ``CSVLogger``'s.

    Example:
        >>> import csv, tempfile
        >>> logger = StepCSVLogger(tempfile.mkdtemp())
        >>> logger.log_metrics({"train/lr": 0.1}, step=9); logger.log_metrics({"train/loss": 2.0}, step=9)
        >>> logger.log_metrics({"train/lr": 0.1}, step=19); logger.finalize("success")
        >>> with open(logger.experiment.metrics_file_path) as f:
        ...     [(row["step"], row["train/loss"], row["train/lr"]) for row in csv.DictReader(f)]
        [('9', '2.0', '0.1'), ('19', '', '0.1')]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: Optional[tuple[int, dict[str, Any]]] = None  # the step being gathered

    def _flush(self) -> None:
        if self._pending is not None:
            step, metrics = self._pending
            self._pending = None
            super().log_metrics(metrics, step)

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        if step is not None and self._pending is not None and self._pending[0] == step:
            self._pending[1].update(metrics)
            return
        self._flush()
        if step is None:
            super().log_metrics(metrics, step)
        else:
            self._pending = (step, dict(metrics))

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._flush()
        super().finalize(status)


class _Series:
    """One logged tag, reduced on the fly (``last``, ``max``, ``min``, ``mean`` of the finite values,
    ``nonfinite``)."""

    def __init__(self, state: Optional[Mapping[str, float]] = None) -> None:
        s = dict(state or {})
        self.count, self.total = int(s.get("count", 0)), float(s.get("total", 0.0))
        self.last, self.max, self.min = s.get("last"), s.get("max"), s.get("min")
        self.nonfinite = bool(s.get("nonfinite", False))

    def add(self, value: float) -> None:
        self.last = value
        if not math.isfinite(value):
            self.nonfinite = True
            return
        self.count += 1
        self.total += value
        self.max = value if self.max is None else max(self.max, value)
        self.min = value if self.min is None else min(self.min, value)

    def reduce(self, how: str) -> Optional[float]:
        if how == "nonfinite":
            return float(self.nonfinite)
        if how == "mean":
            return self.total / self.count if self.count else None
        return {"last": self.last, "max": self.max, "min": self.min}[how]

    def state(self) -> dict[str, Any]:
        return {"count": self.count, "total": self.total, "last": self.last, "max": self.max, "min": self.min,
                "nonfinite": self.nonfinite}


class _Tap(Logger):
    """Hands every metric the run logs (``self.log`` and the monitors alike) to :class:`HParamsSummary`."""

    def __init__(self, owner: "HParamsSummary") -> None:
        super().__init__()
        self._owner = owner

    @property
    @override
    def name(self) -> str:
        return "hparams-summary"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self._owner._observe(metrics)

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class HParamsSummary(Callback):
    """When ``fit`` ends, log the run's hyperparameters and final metrics (:func:`log_hparams`).

    The hyperparameters are the LightningModule's and the DataModule's saved ones (``save_hyperparameters``),
    plus ``extra`` (e.g. the precision and the epochs); the final metrics are reductions of logged tags
    (``summary``). To see every metric the run logs, the callback adds a recording logger after the
    run's own loggers while it fits (a run without a logger logs nothing here). Its reductions are saved
    in checkpoints, so a resumed run's best top-1 and means cover the whole run.

    Args:
        summary: final metric tag -> (logged tag, reduction: one of :data:`REDUCTIONS`).
        extra: hyperparameters to add to the module's and the data's.

    Example:
        >>> summary = HParamsSummary(CLASSIFIER_SUMMARY, extra={"precision": "32-true"})
        >>> summary.state_dict()
        {'series': {}}
    """

    def __init__(self, summary: Mapping[str, tuple[str, str]] = CLASSIFIER_SUMMARY, *,
                 extra: Optional[Mapping[str, Any]] = None) -> None:
        for name, spec in summary.items():
            if not (isinstance(spec, tuple) and len(spec) == 2 and spec[1] in REDUCTIONS):
                raise ValueError(f"HParamsSummary: summary[{name!r}] must be (logged tag, reduction) with a "
                                 f"reduction in {list(REDUCTIONS)}, got {spec!r}.")
        self.summary = dict(summary)
        self.extra = dict(extra or {})
        self._sources = {tag for tag, _ in self.summary.values()}
        self._series: dict[str, _Series] = {}
        self._tap: Optional[_Tap] = None

    def _observe(self, metrics: Mapping[str, Any]) -> None:
        for tag in self._sources.intersection(metrics):
            self._series.setdefault(tag, _Series()).add(float(metrics[tag]))

    def final_metrics(self) -> dict[str, Optional[float]]:
        """The summary's values so far (``None``: its tag was not logged)."""
        out = {}
        for name, (tag, how) in self.summary.items():
            series = self._series.get(tag)
            out[name] = series.reduce(how) if series is not None else None
        return out

    def params(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The module's and the data's hyperparameters, the precision, the budget (``max_epochs``,
        ``max_steps``), the seed (``seed_everything``'s), the world size and global batch, and ``extra``."""
        params: dict[str, Any] = {}
        dm = getattr(trainer, "datamodule", None)
        if dm is not None:
            params.update(getattr(dm, "hparams", {}) or {})
        params.update(pl_module.hparams)
        params["precision"] = str(trainer.precision)
        params["max_epochs"], params["max_steps"] = trainer.max_epochs, trainer.max_steps
        if os.environ.get("PL_GLOBAL_SEED") is not None:  # set by seed_everything
            params["seed"] = int(os.environ["PL_GLOBAL_SEED"])
        params["world_size"] = trainer.world_size
        batch = getattr(dm, "batch_size", None)
        if isinstance(batch, int):
            params["global_batch_size"] = batch * trainer.world_size * trainer.accumulate_grad_batches
        params.update(self.extra)
        return params

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.loggers and self._tap is None:
            self._tap = _Tap(self)
            trainer.loggers = [*trainer.loggers, self._tap]

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._tap is not None:
            trainer.loggers = [lg for lg in trainer.loggers if lg is not self._tap]
            self._tap = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module, "completed", "success")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # nothing lost on a crash: the session of what was measured up to the interruption
        if trainer.state.fn == "fit":
            stopped = isinstance(exception, STOPS)  # Ctrl-C, SIGTERM
            ended = "interrupted" if stopped else f"failed: {type(exception).__name__}"
            self._log(trainer, pl_module, ended, "failure")

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ended: str, status: str) -> None:
        loggers = [lg for lg in trainer.loggers if lg is not self._tap]
        if loggers and trainer.is_global_zero:
            params = {**self.params(trainer, pl_module), "ended": ended}
            log_hparams(loggers, params, self.final_metrics(), step=trainer.global_step,
                        metric_names=list(self.summary), status=status)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"series": {tag: s.state() for tag, s in self._series.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._series = {tag: _Series(s) for tag, s in state_dict.get("series", {}).items()}
