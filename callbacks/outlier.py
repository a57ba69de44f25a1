"""``OutlierMonitor``: activation outliers at the input of every norm layer, live.

It measures the premise of ``docs/method.md`` (:mod:`lightning_mrs.outlier_stats` states it and
defines the figures) on the tensors that really enter the norms during training: on logging steps
only, a forward pre-hook on every norm layer (which ones:
:func:`~lightning_mrs.callbacks.outlier_report.find_norm_inputs`; the hooks:
:class:`~lightning_mrs.callbacks.outlier_report.OutlierCapture`) reduces its input on the device
during the training forward. The life cycle is :class:`~lightning_mrs.callbacks.monitor_base.LoggingStepMonitor`'s.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Sequence

import lightning.pytorch as pl
from typing_extensions import override

from lightning_mrs.callbacks.capture import display_name
from lightning_mrs.callbacks.monitor_base import LoggingStepMonitor
from lightning_mrs.callbacks.outlier_report import OutlierCapture, WatchedNorm, find_norm_inputs
from lightning_mrs.callbacks.tb_layout import OUTLIER
from lightning_mrs.outlier_stats import FIGURE_NAMES, FIGURES, RENAMED

__all__ = ["OutlierMonitor"]


class OutlierMonitor(LoggingStepMonitor[WatchedNorm, OutlierCapture]):
    """Log activation-outlier figures of every norm layer's input as ``z-layers/outlier/<layer>/<figure>``.

    Per layer, over the tokens of the logging step's training forward (a token: the ``C``
    channels of one position; see :mod:`lightning_mrs.outlier_stats` for the exact rules):

    * ``absmax``: the largest ``|x|``;
    * ``rms_share``: ``max_c x_c^2 / sum_c x_c^2``, the largest channel's share of RMSNorm's
      denominator, for the worst token (``1/C`` .. ``1``);
    * ``mrs_share``: ``max_i r_i / sum_i r_i``, ``r_i = |(x_{2i}, x_{2i+1})|``, the largest
      phasor's share of MRSNorm's, for the worst token (even ``C`` only);
    * ``outlier_ratio``: ``max_c |x_c| / median_c |x_c|`` for the worst token (Sun et al.'s
      "massive activations" are ~1000);
    * ``x2_over_fp16_frac``: the share of inputs whose square would overflow float16 if formed
      there (``|x| >= 256``; shipped norms square in float32, so nothing overflowed in them);
      ``fp16_overflow_frac`` in 0.2.0 and before, still accepted in ``figures`` (with a warning);
    * ``kurtosis``: the channels' kurtosis (3 for Gaussian ones), mean over tokens;
    * ``nonfinite``: NaN/Inf inputs (left out of the other figures).

    ``outlier/all/<figure>``: the worst (largest) layer's figure; ``nonfinite`` summed. Under
    DDP the maxima are taken and the sums added over ranks: the figures of the global batch.

    Args:
        log_every_n_steps: capture on the batches Lightning logs at with this interval;
            ``None`` uses the Trainer's ``log_every_n_steps``, and then the figures line up
            with ``self.log``'s.
        figures: the figures to log, any of :data:`lightning_mrs.outlier_stats.FIGURE_NAMES`.
        per_layer: log ``z-layers/outlier/<layer>/*``; ``False`` logs ``outlier/all/*`` only.
        include: a regex; only norm layers whose name matches (``re.search``) are watched.
        dashboard: write the TensorBoard custom-scalars layout ("Activation outliers").

    Example:
        >>> import lightning.pytorch as pl
        >>> from lightning_mrs.callbacks import OutlierMonitor
        >>> trainer = pl.Trainer(callbacks=[OutlierMonitor(figures=["absmax", "rms_share", "mrs_share"])])  # doctest: +SKIP
    """

    owner, board, figures_table, seen, forward_only = "OutlierMonitor", OUTLIER, FIGURES, "tokens", True

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        *,
        figures: Sequence[str] = FIGURE_NAMES,
        per_layer: bool = True,
        include: Optional[str] = None,
        dashboard: bool = True,
    ) -> None:
        super().__init__(log_every_n_steps, include=include, dashboard=dashboard)
        if isinstance(figures, str) or not all(isinstance(f, str) for f in figures):
            raise ValueError(f"OutlierMonitor: figures must be a list of figure names (any of {list(FIGURE_NAMES)}), "
                             f"got {figures!r}.")
        renamed = [f for f in figures if f in RENAMED]
        if renamed:  # a config written for 0.2.0: the same figure under its new name
            warnings.warn(f"OutlierMonitor: figure(s) {renamed} are now called {[RENAMED[f] for f in renamed]} (the "
                          "same value, logged under the new tag); use the new name.", FutureWarning, stacklevel=2)
            figures = [RENAMED.get(f, f) for f in figures]
        unknown = [f for f in figures if f not in FIGURE_NAMES]
        if unknown or not figures:
            raise ValueError(f"OutlierMonitor: figures={list(figures)!r}: {unknown or 'none'} not valid; choose one or "
                             f"more of {list(FIGURE_NAMES)}.")
        self.figures = tuple(f for f in FIGURE_NAMES if f in figures)  # documented order, no repeats
        self.figures_table = {f: FIGURES[f] for f in self.figures}
        self.per_layer = bool(per_layer)

    @override
    def _discover(self, pl_module: pl.LightningModule) -> list[WatchedNorm]:
        found, unwatchable = find_norm_inputs(pl_module)
        found = [dataclasses.replace(layer, name=display_name(layer.name)) for layer in found]
        layers = [layer for layer in found if self._included(layer.name)]
        skipped = [f"{display_name(name) or 'root'} ({type(pl_module.get_submodule(name)).__name__}: {reason})"
                   for name, reason in unwatchable if self._included(display_name(name))]
        return self._found(layers, skipped, "norm layer", (
            "a norm of the swap registry, or a module whose class name contains 'Norm' with a 1-d weight or "
            "normalized_shape"))

    @override
    def _open_capture(self, layers: list[WatchedNorm], step: int, pl_module: pl.LightningModule) -> OutlierCapture:
        return OutlierCapture(layers, step, pl_module.device, self._warn_once)
