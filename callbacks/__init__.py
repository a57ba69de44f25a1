"""Lightning callbacks of lightning-mrs: ``NormSwap``, ``GradientHomogeneityMonitor``, ``AttentionMonitor`` and
``OutlierMonitor``; and ``NormSwapMixin``, for ``load_from_checkpoint`` of a module trained with NormSwap."""

import importlib.util

if importlib.util.find_spec("lightning") is None:  # the core needs only torch; the callbacks are an extra
    raise ImportError("lightning_mrs.callbacks needs Lightning: pip install 'lightning-mrs[callbacks]'")

from lightning_mrs.callbacks.attention import AttentionMonitor
from lightning_mrs.callbacks.homogeneity import GradientHomogeneityMonitor
from lightning_mrs.callbacks.norm_swap import NormSwap
from lightning_mrs.callbacks.outlier import OutlierMonitor
from lightning_mrs.callbacks.swap_mixin import NormSwapMixin

__all__ = ["AttentionMonitor", "GradientHomogeneityMonitor", "NormSwap", "NormSwapMixin", "OutlierMonitor"]
