"""``GradientHomogeneityMonitor``: per-phasor gradient statistics of every norm layer, live.

On logging steps only, the monitor captures the gradient of the loss with respect to the
*input* of every norm layer (MRSNorm and the torch/timm/torchvision norms known to
:mod:`lightning_mrs.norm_registry`), pairs adjacent channels into phasors exactly as MRSNorm
does, and logs how evenly the gradient is spread over the phasors
(:mod:`lightning_mrs.stats` defines every figure). Between logging steps no hook is
registered and nothing runs.

How a logging step works:

1. ``on_train_batch_start``: a forward pre-hook on each norm layer hands the layer an alias
   of its input (``x.view_as(x)``) and registers a tensor hook on it, so the hook sees the
   gradient flowing *through this layer* (not the residual branch that shares ``x``). No
   full backward hooks: those break on in-place activations. A trainable norm whose input
   needs no gradient (the raw input) gets a detached copy that does.
2. During backward each tensor hook reduces ``(x, dL/dx)`` to per-phasor sums, added into one
   flat float64 buffer on the device (micro-batches of gradient accumulation add up).
3. ``on_before_optimizer_step``: the GradScaler's scale in force is read (Lightning unscales
   parameter gradients before this hook, activation gradients stay scaled) and the MRS
   weight gradients are reduced.
4. ``on_train_batch_end``: hooks are removed; under DDP one ``all_reduce`` of the buffer runs
   on every rank (same shape everywhere); the scale dropping across ``optimizer.step`` marks
   a step the scaler skipped; figures are computed on the device, copied to the host once,
   and logged from rank zero through every logger in ``trainer.loggers``. TensorBoard also
   gets ``G_i`` histograms and, once, the "Phasor homogeneity" custom-scalars layout.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_mrs.callbacks.homogeneity_report import MonitoredLayer, step_report
from lightning_mrs.callbacks.tb_layout import metric_tag, tensorboard_experiment, write_layout
from lightning_mrs.swap.registry import NormSpec, iter_norm_layers
from lightning_mrs.stats import phasor_sums, slot_size, weight_grad_stats

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


class GradientHomogeneityMonitor(Callback):
    """Log per-phasor gradient homogeneity of every norm layer as ``phasor/<layer>/<stat>``.

    Per layer (see :func:`lightning_mrs.stats.layer_stats` for exact definitions, ``G_i`` is
    the RMS over batch and positions of phasor ``i``'s input-gradient norm): ``grad_mean``,
    ``grad_cv``, ``grad_max_ratio``, ``grad_p05``/``grad_p50``/``grad_p95``, ``starved_frac``,
    ``radial_frac``, ``act_outlier_ratio``, ``nonfinite``; for MRS layers with a weight also
    ``wgrad_mean`` and ``wgrad_cv``. Aggregates as ``phasor/all/<stat>``
    (:data:`lightning_mrs.stats.ALL_STAT_NAMES`), plus ``phasor/all/overflow_skipped`` (1 when
    a GradScaler skipped the step; the other figures of that step are then not logged) and,
    under fp16, ``phasor/all/loss_scale``.

    Figures are absolute: activation gradients are divided by the GradScaler's scale and, under
    DDP, by the world size (DDP averages parameter gradients over ranks, so each rank's
    activation gradients are ``world_size`` times those of the global-batch loss).

    Args:
        log_every_n_steps: capture every n-th optimizer step (the same steps Lightning logs
            at); ``None`` uses the Trainer's ``log_every_n_steps``.
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
        >>> from callbacks import GradientHomogeneityMonitor
        >>> trainer = pl.Trainer(callbacks=[GradientHomogeneityMonitor()])  # doctest: +SKIP
    """

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
        super().__init__()
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise ValueError(
                "GradientHomogeneityMonitor: log_every_n_steps must be None (use the Trainer's) or an "
                f"int >= 1, got {log_every_n_steps!r}."
            )
        if isinstance(starved_threshold, bool) or not isinstance(starved_threshold, (int, float)) or not (
            0.0 < starved_threshold < 1.0
        ):
            raise ValueError(
                f"GradientHomogeneityMonitor: starved_threshold must lie in (0, 1) (a fraction of the "
                f"median G_i), got {starved_threshold!r}."
            )
        if isinstance(histogram_every_n_logs, bool) or not isinstance(histogram_every_n_logs, int) or (
            histogram_every_n_logs < 0
        ):
            raise ValueError(
                "GradientHomogeneityMonitor: histogram_every_n_logs must be an int >= 0 (0 = never), "
                f"got {histogram_every_n_logs!r}."
            )
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(
                f"GradientHomogeneityMonitor: on_nonfinite={on_nonfinite!r} is not valid; choose one of "
                f"{list(_ON_NONFINITE)}."
            )
        try:
            self._include = re.compile(include) if include is not None else None
        except re.error as err:
            raise ValueError(f"GradientHomogeneityMonitor: include={include!r} is not a valid regex: {err}.") from err
        self.log_every_n_steps = log_every_n_steps
        self.starved_threshold = float(starved_threshold)
        self.histogram_every_n_logs = histogram_every_n_logs
        self.on_nonfinite = on_nonfinite
        self.include = include
        self.weight_grads = weight_grads
        self.dashboard = dashboard
        # persistent counters (state_dict)
        self._n_logs = 0
        self._overflow_skipped_total = 0
        self._nonfinite_total = 0
        # per-capture state
        self._layers: list[MonitoredLayer] = []
        self._handles: list[RemovableHandle] = []
        self._buffer: Optional[Tensor] = None
        self._capture_step: Optional[int] = None
        self._stepped = False
        self._scale: Optional[float] = None
        self._weight_rows: dict[str, tuple[Tensor, Tensor]] = {}
        self._layout_written = False
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ helpers
    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            log_every_n_steps=self.log_every_n_steps, include=self.include
        )

    def _interval(self, trainer: pl.Trainer) -> int:
        return self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    @staticmethod
    def _scaler(trainer: pl.Trainer) -> Any:
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # public on MixedPrecision
        return scaler if scaler is not None and scaler.is_enabled() else None

    def _discover(self, pl_module: pl.LightningModule) -> list[MonitoredLayer]:
        layers, skipped, offset = [], [], 0
        for name, module, spec in iter_norm_layers(pl_module):
            if self._include is not None and not self._include.search(name):
                continue
            reason = _skip_reason(spec)
            if reason is not None:
                skipped.append(f"{name or 'root'} ({type(module).__name__}: {reason})")
                continue
            layers.append(MonitoredLayer(name, module, spec, offset))
            offset += slot_size(spec.num_channels // 2)
        if skipped:
            self._warn_once(
                "skipped:" + ",".join(skipped),
                "GradientHomogeneityMonitor: not monitoring these norm layers: " + "; ".join(skipped) + ".",
            )
        if not layers:
            self._warn_once(
                "nolayers",
                "GradientHomogeneityMonitor: the model has no norm layer it can monitor (MRSNorm, BatchNorm, "
                "LayerNorm, GroupNorm, RMSNorm... with an even channel count); nothing will be logged.",
            )
        return layers

    # ------------------------------------------------------------------ capture
    def _begin(self, pl_module: pl.LightningModule, step: int) -> None:
        self._layers = self._discover(pl_module)
        if not self._layers:
            return
        total = sum(layer.size for layer in self._layers)
        device = pl_module.device
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        self._buffer = torch.zeros(total, dtype=dtype, device=device)  # (sum_l 3 P_l + 2,)
        self._handles = [layer.module.register_forward_pre_hook(partial(self._pre_hook, layer)) for layer in self._layers]
        self._capture_step = step
        self._stepped = False
        self._scale = None
        self._weight_rows = {}

    def _pre_hook(self, layer: MonitoredLayer, module: nn.Module, args: tuple[Any, ...]) -> Optional[tuple[Any, ...]]:
        if not args or not torch.is_grad_enabled():
            return None
        x = args[0]
        if not isinstance(x, Tensor) or not x.is_floating_point():
            return None
        # a trainable norm on a tensor nothing else differentiates (e.g. the raw input) still
        # has an input gradient: ask autograd for it; a frozen one is not worth a backward
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if not x.requires_grad and not trainable:
            return None
        cd = layer.spec.channel_dim
        if x.ndim == 0 or not -x.ndim <= cd < x.ndim or x.shape[cd] != layer.spec.num_channels:
            self._warn_once(
                f"shape:{layer.name}",
                f"GradientHomogeneityMonitor: layer {layer.name!r} ({type(module).__name__}) got an input of shape "
                f"{tuple(x.shape)} without {layer.spec.num_channels} channels on dim {cd}; it is not monitored. "
                "Register its layout with lightning_mrs.register_norm(...) if the registry guessed wrong.",
            )
            return None
        # a node of its own: its gradient is the one through this layer only
        alias = x.view_as(x) if x.requires_grad else x.detach().requires_grad_()
        alias.register_hook(partial(self._grad_hook, layer, x.detach()))
        return (alias, *args[1:])

    def _grad_hook(self, layer: MonitoredLayer, x: Tensor, grad: Tensor) -> None:
        if self._buffer is None:  # capture torn down before backward reached this layer
            return
        try:
            sums = phasor_sums(x, grad, layer.spec.channel_dim)  # (3 P + 2,)
            self._buffer[layer.offset : layer.offset + layer.size] += sums.to(self._buffer.device, self._buffer.dtype)
        except Exception as err:  # noqa: BLE001 - a statistic must never break training
            self._warn_once(f"hook:{layer.name}", f"GradientHomogeneityMonitor: layer {layer.name!r}: {err}")

    def _teardown(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._buffer = None
        self._capture_step = None
        self._stepped = False
        self._weight_rows = {}

    # ------------------------------------------------------------------ hooks
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._capture_step is not None and self._capture_step != step:
            self._teardown()  # a capture whose optimizer step never came: discard
        interval = self._interval(trainer)
        if interval <= 0 or (step + 1) % interval or self._capture_step is not None:
            return
        self._begin(pl_module, step)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._capture_step is None or self._stepped:
            return
        self._stepped = True
        scaler = self._scaler(trainer)
        # the scale the backward ran with: GradScaler.update() only changes it after the step
        self._scale = float(scaler.get_scale()) if scaler is not None else None
        if not self.weight_grads:
            return
        for layer in self._layers:
            weight = getattr(layer.module, "weight", None)
            if layer.spec.kind == "mrs" and isinstance(weight, Tensor) and weight.grad is not None:
                # parameter gradients are already unscaled (Lightning unscales before this hook)
                self._weight_rows[layer.name] = weight_grad_stats(weight.grad)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._capture_step is None or not self._stepped:
            return
        try:
            self._finish(trainer)
        finally:
            self._teardown()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._teardown()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._teardown()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._teardown()

    # ------------------------------------------------------------------ reduce + log
    def _finish(self, trainer: pl.Trainer) -> None:
        for handle in self._handles:  # no hook may fire during the collective / logging
            handle.remove()
        self._handles = []
        buffer, step, layers = self._buffer, self._capture_step, self._layers
        assert buffer is not None and step is not None
        world = max(int(trainer.world_size), 1)
        if world > 1:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(buffer)  # the one collective of a logging step
            else:
                buffer = trainer.strategy.reduce(buffer, reduce_op="sum")
        scaler = self._scaler(trainer)
        skipped = False
        if scaler is not None and self._scale is not None:
            # GradScaler.update() only lowers the scale when it found Inf/NaN and skipped the step
            skipped = float(scaler.get_scale()) < self._scale
        report = step_report(
            layers,
            buffer,
            divisor=(self._scale or 1.0) * world,
            starved_threshold=self.starved_threshold,
            weight_rows=self._weight_rows,
            skipped=skipped,
            scale=self._scale,
        )
        self._nonfinite_total += report.nonfinite
        self._overflow_skipped_total += int(skipped)
        if trainer.is_global_zero:
            self._log(trainer, report.metrics, step, layers, report.g_rms, skipped)
        self._n_logs += 1

        if report.nonfinite and not skipped and self.on_nonfinite != "ignore":
            bad = [f"{name or 'root'}: {n}" for name, n in report.nonfinite_by_layer.items()]
            message = (
                f"GradientHomogeneityMonitor: {report.nonfinite} NaN/Inf gradient entries at step {step} in "
                f"{len(bad)} norm layer(s) ({', '.join(bad[:8])}{', ...' if len(bad) > 8 else ''}). They are "
                "excluded from the statistics; lower the learning rate, clip gradients, or use "
                "on_nonfinite='ignore' to silence this."
            )
            if self.on_nonfinite == "raise":
                raise RuntimeError(message)
            rank_zero_warn(message, category=RuntimeWarning)

    def _log(
        self,
        trainer: pl.Trainer,
        metrics: dict[str, float],
        step: int,
        layers: list[MonitoredLayer],
        g_rms: list[Tensor],
        skipped: bool,
    ) -> None:
        want_hist = (
            self.histogram_every_n_logs > 0 and self._n_logs % self.histogram_every_n_logs == 0 and not skipped
        )
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            experiment = tensorboard_experiment(logger)
            if experiment is None:
                continue
            if self.dashboard and not self._layout_written:
                write_layout(experiment, [layer.name for layer in layers])
            if want_hist and hasattr(experiment, "add_histogram"):
                for layer, g in zip(layers, g_rms):
                    values = g.detach().float().cpu()
                    values = values[torch.isfinite(values)]  # never feed TensorBoard a NaN
                    if values.numel():
                        experiment.add_histogram(metric_tag(layer.name, "G"), values, step)
        if any(tensorboard_experiment(logger) is not None for logger in trainer.loggers):
            self._layout_written = True

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "n_logs": self._n_logs,
            "overflow_skipped_total": self._overflow_skipped_total,
            "nonfinite_total": self._nonfinite_total,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._n_logs = int(state_dict.get("n_logs", 0))
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

