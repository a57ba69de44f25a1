"""Lightning callbacks of lightning-mrs: ``NormSwap`` and ``GradientHomogeneityMonitor``."""
