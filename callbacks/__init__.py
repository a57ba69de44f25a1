"""Lightning callbacks of lightning-mrs: ``NormSwap`` and ``GradientHomogeneityMonitor``."""

from callbacks.homogeneity import GradientHomogeneityMonitor
from callbacks.norm_swap import NormSwap
