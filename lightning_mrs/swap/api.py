"""The public ``swap_norms``: the engine's swap, then a swapped transformers model made a class
that saves in transformers' custom-model format (:mod:`lightning_mrs.swap.hf_format`).

The engine (:mod:`lightning_mrs.swap.engine`) knows nothing of that class: the class rebuilds a
model through the engine (:func:`lightning_mrs.swap.spec.rebuild`), so the engine cannot depend on it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Union

from torch import nn

from lightning_mrs.swap import engine
from lightning_mrs.swap.calibrate import Calibration
from lightning_mrs.swap.hf_format import adopt
from lightning_mrs.swap.options import SwapOptions
from lightning_mrs.swap.report import SwapReport

__all__ = ["swap_norms"]


@functools.wraps(engine.swap_norms)
def swap_norms(model: nn.Module, target: Union[str, SwapOptions, None] = "mrs", *,
               calibration: Optional[Calibration] = None, **options: Any) -> SwapReport:
    report = engine.swap_norms(model, target, calibration=calibration, **options)
    if report.changes or report.qk_added:
        adopt(model)
    return report
