"""The TensorBoard custom-scalars layout of ``GradientHomogeneityMonitor`` ("Phasor homogeneity").

Multiline charts take tag *regexes*, so one chart covers every layer (and ``phasor/all``);
margin charts take exact tags: one per monitored layer, the median ``G_i`` with its 5-95 %
band.

Example:
    >>> layout = homogeneity_layout(["layer1.0.bn1"])
    >>> sorted(layout[CATEGORY])[:2]
    ['G_i of layer1.0.bn1: median, 5-95 % band', 'act_outlier_ratio: max/mean input phasor magnitude']
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["CATEGORY", "homogeneity_layout", "metric_tag", "tensorboard_experiment", "write_layout"]

CATEGORY = "Phasor homogeneity"
PREFIX = "phasor"

# (chart title, [tag regexes]): the cross-layer multiline charts, in display order
_MULTILINE: tuple[tuple[str, list[str]], ...] = (
    ("grad_cv: std/mean of G_i (0 = homogeneous)", [r"^phasor/.*/grad_cv$"]),
    ("starved_frac: share of phasors below threshold x median", [r"^phasor/.*/starved_frac$"]),
    (
        "nonfinite gradient entries and overflow-skipped steps",
        [r"^phasor/.*/nonfinite$", r"^phasor/all/overflow_skipped$"],
    ),
    ("grad_max_ratio: max/median of G_i", [r"^phasor/.*/grad_max_ratio$"]),
    ("grad_mean: mean G_i (unscaled)", [r"^phasor/.*/grad_mean$"]),
    ("radial_frac: gradient energy along each phasor's direction", [r"^phasor/.*/radial_frac$"]),
    ("act_outlier_ratio: max/mean input phasor magnitude", [r"^phasor/.*/act_outlier_ratio$"]),
    ("wgrad_cv: std/mean of |dL/dw_i| (MRS layers)", [r"^phasor/.*/wgrad_cv$"]),
)


def metric_tag(layer: str, stat: str) -> str:
    """``phasor/<layer>/<stat>``; the root module (name ``""``) is called ``root``."""
    return f"{PREFIX}/{layer or 'root'}/{stat}"


def homogeneity_layout(layers: Sequence[str]) -> dict[str, dict[str, list[Any]]]:
    """The layout in ``SummaryWriter.add_custom_scalars`` form, for the given layer names."""
    charts: dict[str, list[Any]] = {title: ["Multiline", tags] for title, tags in _MULTILINE}
    for layer in layers:
        charts[f"G_i of {layer or 'root'}: median, 5-95 % band"] = [
            "Margin",
            [metric_tag(layer, "grad_p50"), metric_tag(layer, "grad_p05"), metric_tag(layer, "grad_p95")],
        ]
    return {CATEGORY: charts}


def write_layout(experiment: Any, layers: Sequence[str]) -> bool:
    """Write the layout through a TensorBoard ``SummaryWriter`` (torch's or tensorboardX's).

    Returns:
        Whether the writer could take it (``add_custom_scalars`` exists).
    """
    add = getattr(experiment, "add_custom_scalars", None)
    if add is None:
        return False
    add(homogeneity_layout(layers))
    return True


def tensorboard_experiment(logger: Any) -> Any:
    """The ``SummaryWriter`` of a Lightning ``TensorBoardLogger``, ``None`` for other loggers."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if not isinstance(logger, TensorBoardLogger):
        return None
    return logger.experiment
