"""Lightning callbacks of lightning-mrs: ``NormSwap``, ``GradientHomogeneityMonitor`` and ``AttentionMonitor``."""

from lightning_mrs.callbacks.attention import AttentionMonitor
from lightning_mrs.callbacks.homogeneity import GradientHomogeneityMonitor
from lightning_mrs.callbacks.norm_swap import NormSwap

__all__ = ["AttentionMonitor", "GradientHomogeneityMonitor", "NormSwap"]
