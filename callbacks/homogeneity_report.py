"""From a logging step's reduced per-phasor sums to the metrics dict the monitor logs.

Kept apart from the callback: this is the part that turns device tensors into named figures,
with the step's single device-to-host copy (every figure travels under its name).

What is logged for a layer on a step:

* no gradient reached it (``count == 0``): nothing;
* the GradScaler skipped the step, or every entry of its input gradient was NaN/Inf
  (``finite == 0``): only ``nonfinite``: figures computed from no finite entry would read
  as "perfectly homogeneous";
* otherwise every figure of :data:`LOGGED_STATS`; MRS layers also ``wgrad_mean`` and
  ``wgrad_cv`` when their weight gradient has a finite entry.

``phasor/all`` pools the layers with a finite gradient (:func:`lightning_mrs.stats.aggregate_stats`);
``phasor/all/nonfinite`` counts over every layer.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_mrs.swap.registry import norm_spec
    >>> from lightning_mrs.stats import phasor_sums
    >>> layer = MonitoredLayer("ln", nn.LayerNorm(4), norm_spec(nn.LayerNorm(4)))
    >>> sums = {"ln": phasor_sums(torch.randn(3, 4), torch.randn(3, 4), -1).to(torch.float64)}
    >>> report = step_report([layer], sums, divisor=1.0, starved_threshold=0.1, weights={})
    >>> sorted(report.metrics)[:2]
    ['phasor/all/act_outlier_ratio', 'phasor/all/grad_cv']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from lightning_mrs.callbacks.capture import to_host
from lightning_mrs.callbacks.homogeneity_capture import MonitoredLayer
from lightning_mrs.callbacks.tb_layout import HOMOGENEITY
from lightning_mrs.stats import STAT_NAMES, WEIGHT_STAT_NAMES, PhasorSums, aggregate_stats, layer_stats

__all__ = ["LOGGED_STATS", "LOGGED_WEIGHT_STATS", "StepReport", "step_report"]

#: Per-layer figures logged on a step with a finite gradient (``count``, ``finite`` are not).
LOGGED_STATS: tuple[str, ...] = tuple(s for s in STAT_NAMES if s not in ("finite", "count"))
#: Weight-gradient figures logged for MRS layers (not the counts).
LOGGED_WEIGHT_STATS: tuple[str, ...] = tuple(s for s in WEIGHT_STAT_NAMES if not s.endswith("finite"))


@dataclass
class StepReport:
    """What one logging step produced."""

    metrics: dict[str, float]  # tag -> value, every value finite
    nonfinite: int  # NaN/Inf entries over all layers (input and weight gradients)
    nonfinite_by_layer: dict[str, int] = field(default_factory=dict)  # only layers with some
    g_rms: dict[str, Tensor] = field(default_factory=dict)  # (P,) G_i of the layers with a finite gradient


def step_report(
    layers: Sequence[MonitoredLayer],
    sums: Mapping[str, PhasorSums],
    *,
    divisor: float,
    starved_threshold: float,
    weights: Mapping[str, Mapping[str, Tensor]],
    skipped: bool = False,
    scale: Optional[float] = None,
) -> StepReport:
    """Compute every figure of a logging step on the sums' device, copy to the host once.

    Args:
        layers: the monitored layers.
        sums: layer name -> its sums, already reduced over ranks.
        divisor: true-gradient divisor (GradScaler scale x world size).
        starved_threshold: see :func:`lightning_mrs.stats.layer_stats`.
        weights: MRS layer name -> :func:`lightning_mrs.stats.weight_grad_stats` output.
        skipped: the GradScaler skipped this step: only ``nonfinite`` figures are kept.
        scale: the GradScaler scale in force, logged as ``phasor/all/loss_scale``.
    """
    rows, g_rms = {}, {}
    for layer in layers:
        rows[layer.name], g_rms[layer.name] = layer_stats(
            sums[layer.name], grad_divisor=divisor, starved_threshold=starved_threshold
        )
    agg = aggregate_stats([rows[layer.name] for layer in layers], [layer.num_phasors for layer in layers])
    on_device: dict[tuple[str, ...], Tensor] = {("all", stat): v for stat, v in agg.items()}
    on_device.update({("layer", name, stat): v for name, row in rows.items() for stat, v in row.items()})
    on_device.update({("weight", name, stat): v for name, row in weights.items() for stat, v in row.items()})
    host = {key: v.item() for key, v in to_host(on_device, torch.float64).items()}  # one copy

    metrics: dict[str, float] = {}
    nonfinite_by_layer: dict[str, int] = {}
    reached = False
    for layer in layers:
        stat = {s: host["layer", layer.name, s] for s in rows[layer.name]}
        w = {s: host["weight", layer.name, s] for s in weights.get(layer.name, {})}
        nonfinite = stat["nonfinite"] + w.get("wgrad_nonfinite", 0.0)
        if nonfinite:
            nonfinite_by_layer[layer.name] = int(nonfinite)
        if stat["count"] <= 0:
            continue  # no gradient reached this layer on this step
        reached = True
        metrics[HOMOGENEITY.tag(layer.name, "nonfinite")] = nonfinite
        if skipped:
            continue
        if stat["finite"] > 0:
            metrics.update({HOMOGENEITY.tag(layer.name, s): stat[s] for s in LOGGED_STATS if s != "nonfinite"})
        if w.get("wgrad_finite", 0.0) > 0:
            metrics.update({HOMOGENEITY.tag(layer.name, s): w[s] for s in LOGGED_WEIGHT_STATS})
    total_nonfinite = host["all", "nonfinite"] + sum(host["weight", name, "wgrad_nonfinite"] for name in weights)
    if reached:
        metrics[HOMOGENEITY.tag("all", "nonfinite")] = total_nonfinite
        if not skipped:
            metrics[HOMOGENEITY.tag("all", "layers")] = host["all", "layers"]
            if host["all", "layers"] > 0:
                metrics.update(
                    {HOMOGENEITY.tag("all", s): host["all", s] for s in agg if s not in ("nonfinite", "layers")}
                )
    metrics[HOMOGENEITY.tag("all", "overflow_skipped")] = float(skipped)
    if scale is not None:
        metrics[HOMOGENEITY.tag("all", "loss_scale")] = scale
    return StepReport(
        metrics=metrics,
        nonfinite=int(total_nonfinite),
        nonfinite_by_layer=nonfinite_by_layer,
        g_rms={name: g for name, g in g_rms.items() if host["layer", name, "finite"] > 0},
    )
