"""Lightning callbacks of lightning-mrs: ``NormSwap``, ``GradientHomogeneityMonitor``, ``AttentionMonitor`` and
``OutlierMonitor``."""

from lightning_mrs.callbacks.attention import AttentionMonitor
from lightning_mrs.callbacks.homogeneity import GradientHomogeneityMonitor
from lightning_mrs.callbacks.norm_swap import NormSwap
from lightning_mrs.callbacks.outlier import OutlierMonitor

__all__ = ["AttentionMonitor", "GradientHomogeneityMonitor", "NormSwap", "OutlierMonitor"]
