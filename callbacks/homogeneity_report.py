"""From a logging step's reduced per-phasor sums to the metrics dict the monitor logs.

Kept apart from the callback: this is the part that turns device tensors into named figures,
with the step's single device-to-host copy.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from lightning_mrs.swap.registry import norm_spec
    >>> from lightning_mrs.stats import phasor_sums
    >>> layer = MonitoredLayer("ln", nn.LayerNorm(4), norm_spec(nn.LayerNorm(4)), offset=0)
    >>> buffer = phasor_sums(torch.randn(3, 4), torch.randn(3, 4), -1).double()
    >>> report = step_report([layer], buffer, divisor=1.0, starved_threshold=0.1, weight_rows={})
    >>> sorted(report.metrics)[:2]
    ['phasor/all/act_outlier_ratio', 'phasor/all/grad_cv']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_mrs.callbacks.tb_layout import metric_tag
from lightning_mrs.swap.registry import NormSpec
from lightning_mrs.stats import ALL_STAT_NAMES, STAT_NAMES, WEIGHT_STAT_NAMES, aggregate_stats, layer_stats, slot_size

__all__ = ["MonitoredLayer", "StepReport", "step_report"]

_LOGGED_STATS = tuple(s for s in STAT_NAMES if s != "count")


@dataclass
class MonitoredLayer:
    """A norm layer under watch and its slot ``[offset, offset + size)`` in the flat buffer."""

    name: str
    module: nn.Module
    spec: NormSpec
    offset: int

    @property
    def num_phasors(self) -> int:
        return self.spec.num_channels // 2

    @property
    def size(self) -> int:
        return slot_size(self.num_phasors)


@dataclass
class StepReport:
    """What one logging step produced."""

    metrics: dict[str, float]  # tag -> value, every value finite
    nonfinite: int  # NaN/Inf entries over all layers
    nonfinite_by_layer: dict[str, int] = field(default_factory=dict)  # only layers with some
    g_rms: list[Tensor] = field(default_factory=list)  # (P,) G_i per layer, on the device


def step_report(
    layers: Sequence[MonitoredLayer],
    buffer: Tensor,
    *,
    divisor: float,
    starved_threshold: float,
    weight_rows: dict[str, tuple[Tensor, Tensor]],
    skipped: bool = False,
    scale: Optional[float] = None,
) -> StepReport:
    """Compute every figure of a logging step on the buffer's device, copy to the host once.

    Args:
        layers: the monitored layers (their slots index ``buffer``).
        buffer: the flat per-phasor sums, already reduced over ranks.
        divisor: true-gradient divisor (GradScaler scale x world size).
        starved_threshold: see :func:`lightning_mrs.stats.layer_stats`.
        weight_rows: MRS layer name -> :func:`lightning_mrs.stats.weight_grad_stats` output.
        skipped: the GradScaler skipped this step: only ``nonfinite`` figures are kept.
        scale: the GradScaler scale in force, logged as ``phasor/all/loss_scale``.
    """
    rows, g_rms = [], []
    for layer in layers:
        stats, g = layer_stats(
            buffer[layer.offset : layer.offset + layer.size],
            layer.num_phasors,
            grad_divisor=divisor,
            starved_threshold=starved_threshold,
        )
        rows.append(stats)
        g_rms.append(g)
    table = torch.stack(rows)  # (L, len(STAT_NAMES))
    agg = aggregate_stats(table, torch.tensor([layer.num_phasors for layer in layers]))  # (len(ALL),)
    weights = [weight_rows.get(layer.name) for layer in layers]
    w_stats = torch.stack([w[0].to(agg) if w is not None else agg.new_zeros(2) for w in weights])  # (L, 2)
    w_nonfinite = torch.stack([w[1].to(agg) if w is not None else agg.new_zeros(()) for w in weights])  # (L,)
    host = torch.cat([table.flatten(), agg, w_stats.flatten(), w_nonfinite]).cpu().tolist()  # the one copy

    n_l, n_s, n_a = len(layers), len(STAT_NAMES), len(ALL_STAT_NAMES)
    per_layer = [dict(zip(STAT_NAMES, host[i * n_s : (i + 1) * n_s])) for i in range(n_l)]
    all_stats = dict(zip(ALL_STAT_NAMES, host[n_l * n_s : n_l * n_s + n_a]))
    pos = n_l * n_s + n_a
    w_host = [host[pos + 2 * i : pos + 2 * i + 2] for i in range(n_l)]
    w_nf = host[pos + 2 * n_l :]
    for stats, extra in zip(per_layer, w_nf):
        stats["nonfinite"] += extra
    all_stats["nonfinite"] += sum(w_nf)

    metrics: dict[str, float] = {}
    for layer, stats, w, w_vals in zip(layers, per_layer, weights, w_host):
        if stats["count"] <= 0:
            continue  # no gradient reached this layer on this step
        if skipped:
            metrics[metric_tag(layer.name, "nonfinite")] = stats["nonfinite"]
            continue
        metrics.update({metric_tag(layer.name, s): stats[s] for s in _LOGGED_STATS})
        if w is not None:
            metrics.update({metric_tag(layer.name, s): v for s, v in zip(WEIGHT_STAT_NAMES, w_vals)})
    if all_stats["layers"] > 0:
        if skipped:
            metrics[metric_tag("all", "nonfinite")] = all_stats["nonfinite"]
        else:
            metrics.update({metric_tag("all", s): v for s, v in all_stats.items()})
    metrics[metric_tag("all", "overflow_skipped")] = float(skipped)
    if scale is not None:
        metrics[metric_tag("all", "loss_scale")] = scale
    return StepReport(
        metrics=metrics,
        nonfinite=int(all_stats["nonfinite"]),
        nonfinite_by_layer={layer.name: int(s["nonfinite"]) for layer, s in zip(layers, per_layer) if s["nonfinite"]},
        g_rms=g_rms,
    )
