"""``GradientHomogeneityMonitor``: per-phasor gradient statistics of every norm layer, live.

On logging steps only, the monitor captures the gradient of the loss with respect to the
*input* of every norm layer (MRSNorm and the torch/timm/torchvision norms known to
:mod:`lightning_mrs.swap.registry`), pairs adjacent channels into phasors exactly as MRSNorm
does, and logs how evenly the gradient is spread over the phasors
(:mod:`lightning_mrs.stats` defines every figure). Between logging steps no hook is
registered and nothing runs but a step-number check.

The life cycle (Lightning's logging steps under automatic and manual optimization, opening and
closing a capture, the one collective, logging, warnings, state) is
:class:`~lightning_mrs.callbacks.monitor_base.LoggingStepMonitor`'s; the hooks that see each
layer's input gradient are :class:`~lightning_mrs.callbacks.homogeneity_capture.Capture`'s, the
figures :func:`~lightning_mrs.callbacks.homogeneity_report.step_report`'s. This module adds the
GradScaler: ``on_before_optimizer_step`` reads the scale the backward ran with (Lightning unscales
parameter gradients before this hook, activation gradients stay scaled) and has the weight
gradients of the MRS layers this optimizer owns reduced; the scale dropping across
``optimizer.step`` marks a step the scaler skipped. TensorBoard also gets ``G_i`` histograms.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_mrs.callbacks.capture import display_name, reduce_over_ranks
from lightning_mrs.callbacks.homogeneity_capture import Capture, MonitoredLayer
from lightning_mrs.callbacks.homogeneity_report import StepReport, step_report
from lightning_mrs.callbacks.monitor_base import LoggingStepMonitor, check_count, check_fraction
from lightning_mrs.callbacks.tb_layout import HOMOGENEITY
from lightning_mrs.swap.registry import NormSpec, iter_norm_layers

__all__ = ["GradientHomogeneityMonitor"]

_ON_NONFINITE = ("warn", "raise", "ignore")
# norm kinds whose input still has one channel dim to pair, although no swap replaces them
_MONITORABLE_UNSUPPORTED = ("evo", "frn", "grn", "lrn")


def _skip_reason(spec: NormSpec) -> Optional[str]:
    """Why a norm layer cannot be monitored (``None`` when it can)."""
    if spec.unsupported is not None and spec.kind not in _MONITORABLE_UNSUPPORTED:
        return spec.unsupported
    if spec.num_channels < 2 or spec.num_channels % 2:
        return f"{spec.num_channels} channels cannot be paired into phasors (needs an even count)"
    return None


class GradientHomogeneityMonitor(LoggingStepMonitor[MonitoredLayer, Capture]):
    """Log per-phasor gradient homogeneity of every norm layer as ``z-layers/phasor/<layer>/<stat>``.

    Per layer (see :func:`lightning_mrs.stats.layer_stats` for exact definitions, ``G_i`` is
    the RMS over batch and positions of phasor ``i``'s input-gradient norm): ``grad_mean``,
    ``grad_cv``, ``grad_max_ratio``, ``grad_p05``/``grad_p50``/``grad_p95``, ``starved_frac``,
    ``radial_frac``, ``act_outlier_ratio``, ``nonfinite``; for MRS layers with a weight also
    ``wgrad_mean`` and ``wgrad_cv``. Aggregates as ``phasor/all/<stat>``
    (:data:`lightning_mrs.stats.ALL_STAT_NAMES`), plus ``phasor/all/overflow_skipped`` (1 when
    a GradScaler skipped the step; the other figures of that step are then not logged) and,
    under fp16, ``phasor/all/loss_scale``. A layer none of whose input-gradient entries is finite
    on a step logs only its ``nonfinite`` count there and is left out of ``phasor/all``.

    Figures are absolute: activation gradients are divided by the GradScaler's scale and, under
    DDP, by the world size (DDP averages parameter gradients over ranks, so each rank's
    activation gradients are ``world_size`` times those of the global-batch loss).

    Args:
        log_every_n_steps: capture on the batches Lightning logs at with this interval (the
            n-th, 2n-th... optimizer step, or batch under manual optimization); ``None`` uses
            the Trainer's ``log_every_n_steps``, and then the figures line up with ``self.log``'s.
            A warning says when the run is too short for a single logging step.
        starved_threshold: a phasor is starved when its ``G_i`` is below this fraction of the
            layer's median ``G_i``; in ``(0, 1)``.
        histogram_every_n_logs: write ``G_i`` histograms to TensorBoard on every n-th logging
            step (the first included); ``0`` never.
        on_nonfinite: what to do when NaN/Inf gradient entries are seen on a step the scaler
            did not skip: ``"warn"`` (default), ``"raise"`` (a ``RuntimeError`` naming the
            layers, after logging) or ``"ignore"``. They are always counted.
        include: a regex; only norm layers whose name matches (``re.search``) are monitored.
        weight_grads: also log MRS layers' per-phasor weight-gradient figures.
        dashboard: write the TensorBoard custom-scalars layout ("Phasor homogeneity").

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_mrs.callbacks import GradientHomogeneityMonitor
        >>> trainer = pl.Trainer(callbacks=[GradientHomogeneityMonitor()])  # doctest: +SKIP
    """

    owner = "GradientHomogeneityMonitor"
    board = HOMOGENEITY

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        *,
        starved_threshold: float = 0.1,
        histogram_every_n_logs: int = 10,
        on_nonfinite: str = "warn",
        include: Optional[str] = None,
        weight_grads: bool = True,
        dashboard: bool = True,
    ) -> None:
        super().__init__(log_every_n_steps, include=include, dashboard=dashboard)
        check_fraction(self.owner, "starved_threshold", starved_threshold, "a fraction of the median G_i")
        check_count(self.owner, "histogram_every_n_logs", histogram_every_n_logs, " (0 = never)", minimum=0, none=False)
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(
                f"GradientHomogeneityMonitor: on_nonfinite={on_nonfinite!r} is not valid; choose one of "
                f"{list(_ON_NONFINITE)}."
            )
        self.starved_threshold = float(starved_threshold)
        self.histogram_every_n_logs = histogram_every_n_logs
        self.on_nonfinite = on_nonfinite
        self.weight_grads = weight_grads
        # persistent counters (state_dict), with the base class's
        self._overflow_skipped_total = 0
        self._nonfinite_total = 0

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _scaler(trainer: pl.Trainer) -> Any:
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # public on MixedPrecision
        return scaler if scaler is not None and scaler.is_enabled() else None

    @override
    def _discover(self, pl_module: pl.LightningModule) -> list[MonitoredLayer]:
        layers, skipped = [], []
        for name, module, spec in iter_norm_layers(pl_module):
            name = display_name(name)
            if not self._included(name):
                continue
            reason = _skip_reason(spec)
            if reason is not None:
                skipped.append(f"{name or 'root'} ({type(module).__name__}: {reason})")
                continue
            layers.append(MonitoredLayer(name, module, spec))
        return self._found(layers, skipped, "norm layer",
                           "MRSNorm, BatchNorm, LayerNorm, GroupNorm, RMSNorm... with an even channel count")

    @override
    def _open_capture(self, layers: list[MonitoredLayer], step: int, pl_module: pl.LightningModule) -> Capture:
        return Capture(layers, step, pl_module.device, self._warn_once)

    # ------------------------------------------------------------------ hooks
    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        capture = self._capture
        if capture is not None and not capture.stepped:
            scaler = self._scaler(trainer)
            # the scale the backward ran with: GradScaler.update() only changes it after the step
            capture.scale = float(scaler.get_scale()) if scaler is not None else None
        super().on_before_optimizer_step(trainer, pl_module, optimizer)  # marks the capture stepped
        if capture is not None and self.weight_grads:
            capture.record_weights(optimizer)

    # ------------------------------------------------------------------ reduce + log
    @override
    def _finish(self, trainer: pl.Trainer, capture: Capture) -> None:
        sums = capture.reduced(partial(reduce_over_ranks, trainer.strategy))  # the one collective: a sum
        scaler = self._scaler(trainer)
        if scaler is not None and capture.scale is None:  # manual optimization without a step
            capture.scale = float(scaler.get_scale())
        # GradScaler.update() only lowers the scale when it found Inf/NaN and skipped the step
        skipped = scaler is not None and capture.stepped and float(scaler.get_scale()) < capture.scale
        report = step_report(
            capture.layers,
            sums,
            divisor=(capture.scale or 1.0) * max(int(trainer.world_size), 1),
            starved_threshold=self.starved_threshold,
            weights=capture.weights,
            skipped=skipped,
            scale=capture.scale,
        )
        self._nonfinite_total += report.nonfinite
        self._overflow_skipped_total += int(skipped)
        self._log(trainer, report, capture, skipped)

        if report.nonfinite and not skipped and self.on_nonfinite != "ignore":
            bad = [f"{name or 'root'}: {n}" for name, n in report.nonfinite_by_layer.items()]
            message = (
                f"GradientHomogeneityMonitor: {report.nonfinite} NaN/Inf gradient entries at step {capture.step} in "
                f"{len(bad)} norm layer(s) ({', '.join(bad[:8])}{', ...' if len(bad) > 8 else ''}). They are "
                "excluded from the statistics; lower the learning rate, clip gradients, or use "
                "on_nonfinite='ignore' to silence this."
            )
            if self.on_nonfinite == "raise":
                raise RuntimeError(message)
            rank_zero_warn(message, category=RuntimeWarning)

    def _log(self, trainer: pl.Trainer, report: StepReport, capture: Capture, skipped: bool) -> None:
        experiments = self._publish(trainer, report.metrics, capture.step, [layer.name for layer in capture.layers])
        if not (self.histogram_every_n_logs > 0 and self._n_logs % self.histogram_every_n_logs == 0 and not skipped):
            return
        for experiment in experiments:
            if not hasattr(experiment, "add_histogram"):
                continue
            for name, g in report.g_rms.items():
                values = g.detach().float().cpu()
                values = values[values.isfinite()]  # never feed TensorBoard a NaN
                if values.numel():
                    experiment.add_histogram(HOMOGENEITY.tag(name, "G"), values, capture.step)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "overflow_skipped_total": self._overflow_skipped_total,
            "nonfinite_total": self._nonfinite_total,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._overflow_skipped_total = int(state_dict.get("overflow_skipped_total", 0))
        self._nonfinite_total = int(state_dict.get("nonfinite_total", 0))

    @property
    def overflow_skipped_total(self) -> int:
        """Logging steps a GradScaler skipped so far."""
        return self._overflow_skipped_total

    @property
    def nonfinite_total(self) -> int:
        """NaN/Inf gradient entries counted so far, over all logging steps."""
        return self._nonfinite_total
