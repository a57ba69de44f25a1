"""The monitors' TensorBoard custom-scalars dashboards: one category each, merged per run.

A :class:`Dashboard` is one category of the custom-scalars plugin: multiline charts take tag
*regexes*, so one chart covers every layer (and ``<prefix>/all``); an optional margin chart
per layer takes exact tags (a value with its band).

Tags: the summary over layers is ``<prefix>/all/<stat>``; a layer's figures are
``z-layers/<prefix>/<layer>/<stat>`` (:data:`LAYERS`). TensorBoard's Time Series sorts its cards
by tag and groups them by the tag's first component, so the groups appear in name order:
``attention``, ``phasor`` (a page of summaries each), ``train``, ``val``, then ``z-layers`` with
every per-layer card, which would otherwise sit inside the ``phasor`` group above ``train``. :data:`HOMOGENEITY` is
``GradientHomogeneityMonitor``'s ("Phasor homogeneity"), :data:`ATTENTION`
``AttentionMonitor``'s ("Attention").

TensorBoard shows the *last* layout a run wrote, so two monitors writing their own would
hide each other: :meth:`Dashboard.write` remembers, per ``SummaryWriter``, the categories
written to it and writes all of them each time.

Example:
    >>> layout = HOMOGENEITY.layout(["layer1.0.bn1"])
    >>> sorted(layout[HOMOGENEITY.category])[:2]
    ['G_i of layer1.0.bn1: median, 5-95 % band', 'act_outlier_ratio: max/mean input phasor magnitude']
    >>> ATTENTION.tag("blocks.0.attn", "logit_max"), ATTENTION.tag("all", "logit_max")
    ('z-layers/attention/blocks.0.attn/logit_max', 'attention/all/logit_max')
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["ATTENTION", "HOMOGENEITY", "LAYERS", "OUTLIER", "PER_CHART", "Dashboard", "blocks", "tensorboard_experiment"]

#: the first component of every per-layer tag (after ``val`` in the Time Series' name order)
LAYERS = "z-layers"

Charts = dict[str, list[Any]]  # chart title -> ["Multiline", [regexes]] | ["Margin", [value, lower, upper]]

# SummaryWriter -> category -> charts: what each writer shows (weak: a writer may go away)
_WRITTEN: "weakref.WeakKeyDictionary[Any, dict[str, Charts]]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Dashboard:
    """One custom-scalars category of a monitor.

    Attributes:
        category: the category's title.
        prefix: the monitor's part of every tag (``<prefix>/all/<stat>``, ``z-layers/<prefix>/<layer>/<stat>``).
        charts: ``(title, stats)`` of the multiline charts, in display order: each stat is charted
            over ``<prefix>/all`` and, per block of layers, over those layers; a stat written as a
            regex (``"^...$"``) is a summary tag alone, charted as it is.
        band: ``(title with "{layer}", (value, lower, upper) stats)``: one margin chart per layer.
    """

    category: str
    prefix: str
    charts: tuple[tuple[str, tuple[str, ...]], ...]
    band: Optional[tuple[str, tuple[str, str, str]]] = None

    def tag(self, layer: str, stat: str) -> str:
        """``<prefix>/all/<stat>`` for ``layer="all"`` (the summary), else ``z-layers/<prefix>/<layer>/<stat>``;
        the root module (name ``""``) is called ``root``."""
        if layer == "all":
            return f"{self.prefix}/all/{stat}"
        return f"{LAYERS}/{self.prefix}/{layer or 'root'}/{stat}"

    def layout(self, layers: Sequence[str]) -> dict[str, Charts]:
        """The layout in ``SummaryWriter.add_custom_scalars`` form, for the given layer names.

        The category's charts show the summary (``<prefix>/all``); each block of layers
        (:func:`blocks`: at most :data:`PER_CHART` layers) gets a category of its own below,
        ``"<category>: <block>"``, with the same charts over its layers alone, so that every
        line of a chart can be told apart (the lines of one chart share a colour; a tooltip
        names the tag).
        """
        charts: Charts = {title: ["Multiline", [s if s.startswith("^") else f"^{self.prefix}/all/{s}$" for s in stats]]
                          for title, stats in self.charts}
        if self.band is not None:
            title, stats = self.band
            for layer in layers:
                charts[title.format(layer=layer or "root")] = ["Margin", [self.tag(layer, s) for s in stats]]
        out = {self.category: charts}
        for block in blocks(layers):
            names = "|".join(re.escape(layer or "root") for layer in block)
            per_block: Charts = {title: ["Multiline", [f"^{LAYERS}/{self.prefix}/({names})/{s}$" for s in stats
                                                       if not s.startswith("^")]]
                                 for title, stats in self.charts if not all(s.startswith("^") for s in stats)}
            if per_block:
                out[f"{self.category}: {', '.join(layer or 'root' for layer in block)}"] = per_block
        return out

    def write(self, experiment: Any, layers: Sequence[str]) -> bool:
        """Write this category, with every other one written to ``experiment`` before, through a
        TensorBoard ``SummaryWriter`` (torch's or tensorboardX's).

        Returns:
            Whether the writer could take it (``add_custom_scalars`` exists).
        """
        add = getattr(experiment, "add_custom_scalars", None)
        if add is None:
            return False
        try:
            shown = _WRITTEN.setdefault(experiment, {})
        except TypeError:  # a writer that cannot be weakly referenced: this category alone
            shown = {}
        shown.update(self.layout(layers))
        add(dict(shown))
        return True


#: the most layers one per-block chart overlays
PER_CHART = 4


def blocks(layers: Sequence[str]) -> list[list[str]]:
    """``layers`` in model order, cut into runs of at most :data:`PER_CHART`, a block's layers kept
    together where they fit (a block: the name up to its first numbered part, ``layer1.0``,
    ``model.layers.3``).

    Example:
        >>> blocks(["bn1", "layer1.0.bn1", "layer1.0.bn2", "layer1.1.bn1", "layer1.1.bn2", "fc_norm"])
        [['bn1', 'layer1.0.bn1', 'layer1.0.bn2'], ['layer1.1.bn1', 'layer1.1.bn2', 'fc_norm']]
    """
    groups: list[list[str]] = []
    for layer in layers:
        parts = layer.split(".")
        cut = next((i + 1 for i, part in enumerate(parts) if part.isdigit()), len(parts))
        key = ".".join(parts[:cut])
        if groups and groups[-1][0] == key:
            groups[-1][1].append(layer)
        else:
            groups.append([key, [layer]])
    out: list[list[str]] = []
    for _, members in groups:
        for i in range(0, len(members), PER_CHART):
            chunk = members[i:i + PER_CHART]
            if out and len(out[-1]) + len(chunk) <= PER_CHART:
                out[-1].extend(chunk)
            else:
                out.append(list(chunk))
    return out


HOMOGENEITY = Dashboard(
    category="Phasor homogeneity",
    prefix="phasor",
    charts=(
        ("grad_cv: std/mean of G_i (0 = homogeneous)", ("grad_cv",)),
        ("starved_frac: share of phasors below threshold x median", ("starved_frac",)),
        ("nonfinite gradient entries and overflow-skipped steps", ("nonfinite", r"^phasor/all/overflow_skipped$")),
        ("grad_max_ratio: max/median of G_i", ("grad_max_ratio",)),
        ("grad_mean: mean G_i (unscaled)", ("grad_mean",)),
        ("radial_frac: gradient energy along each phasor's direction", ("radial_frac",)),
        ("act_outlier_ratio: max/mean input phasor magnitude", ("act_outlier_ratio",)),
        ("wgrad_cv: std/mean of |dL/dw_i| (MRS layers)", ("wgrad_cv",)),
    ),
    band=("G_i of {layer}: median, 5-95 % band", ("grad_p50", "grad_p05", "grad_p95")),
)

ATTENTION = Dashboard(
    category="Attention",
    prefix="attention",
    charts=(
        ("logit_max: largest |q.k| x scale (worst layer in all)", ("logit_max",)),
        ("collapsed_frac: share of attention rows with max weight > threshold", ("collapsed_frac",)),
        ("entropy_mean: softmax entropy in nats, mean over heads and queries", ("entropy_mean",)),
        ("entropy_min: mean entropy of the lowest head", ("entropy_min",)),
        ("q_norm_mean, k_norm_mean: mean |q|, |k| after the QK-norm", ("q_norm_mean", "k_norm_mean")),
    ),
)


#: ``OutlierMonitor``'s custom-scalars category ("Activation outliers").
OUTLIER = Dashboard(
    category="Activation outliers",
    prefix="outlier",
    charts=(
        ("share of the largest channel in the denominator, worst layer: RMSNorm's vs MRSNorm's",
         (r"^outlier/all/rms_share$", r"^outlier/all/mrs_share$")),
        ("absmax: largest |x| entering each norm (worst layer in all)", ("absmax",)),
        ("rms_share: max_c x_c^2 / sum_c x_c^2, worst token", ("rms_share",)),
        ("mrs_share: max_i r_i / sum_i r_i (phasor pairs), worst token", ("mrs_share",)),
        ("outlier_ratio: max_c |x_c| / median_c |x_c|, worst token (massive activations)", ("outlier_ratio",)),
        ("x2_over_fp16_frac: share of inputs whose square would overflow float16 (|x| >= 256); "
         "fp16_overflow_frac in 0.2.0 and before", ("x2_over_fp16_frac", "fp16_overflow_frac")),
        ("kurtosis over channels, mean over tokens (3 = Gaussian)", ("kurtosis",)),
        ("nonfinite: NaN/Inf inputs", ("nonfinite",)),
    ),
)


def tensorboard_experiment(logger: Any) -> Any:
    """The ``SummaryWriter`` of a Lightning ``TensorBoardLogger``, ``None`` for other loggers."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if not isinstance(logger, TensorBoardLogger):
        return None
    return logger.experiment
