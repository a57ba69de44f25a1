"""Lightning callbacks of lightning-mrs: ``NormSwap`` and ``GradientHomogeneityMonitor``."""

from lightning_mrs.callbacks.homogeneity import GradientHomogeneityMonitor
from lightning_mrs.callbacks.norm_swap import NormSwap
