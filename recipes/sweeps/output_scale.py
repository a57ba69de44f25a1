"""Output-scale controls for the ``lm`` sweep: a norm whose gain starts at another formula's output scale.

MRSNorm's output is smaller than RMSNorm's for the same input, so a smaller norm output alone could
slow a residual stream's growth. An arm ``<norm>-as-<family>`` (e.g. ``rms-half-safe-as-mrs``) is the
norm ``<norm>`` with every gain of every swapped norm multiplied at initialisation by
``OUTPUT_RMS[<family>] / OUTPUT_RMS[<its own family>]``, so that on Gaussian inputs its output has
the other formula's per-channel RMS; everything else (formula, arithmetic, learning) is unchanged.

The per-channel output RMS on x ~ N(0, I_C), unit gains (``docs/results-lm.md``, "Output scale"):

* RMSNorm ``y = x / sqrt(mean_c x_c^2)``: ``sum_c y_c^2 = C`` exactly, so ``E[y_c^2] = 1``, RMS 1.
* MRSNorm ``y = x / S``, ``S = mean_i r_i``, ``r_i = |(x_2i, x_2i+1)|``: each ``r_i`` is Rayleigh(1)
  (the norm of a standard 2-D Gaussian), with mean ``sqrt(pi/2)``; by the law of large numbers
  ``S -> sqrt(pi/2)``, so ``E[y_c^2] -> E[x_c^2] / S^2 = 2/pi`` and the RMS is ``sqrt(2/pi) ~ 0.798``
  (for a finite C slightly less, as a large ``x_c`` also raises ``S``: 0.793 at C = 32, 0.796 at C = 64,
  float64 Monte Carlo).

Needs no torch (:func:`scale_gains` imports it).
"""

from __future__ import annotations

import math
from typing import Any, Optional

__all__ = ["OUTPUT_RMS", "SUFFIX", "family", "gain_factor", "scale_gains", "split_gain"]

#: a formula family -> its per-channel output RMS on standard Gaussian inputs with unit gains (C -> infinity)
OUTPUT_RMS = {"rms": 1.0, "mrs": math.sqrt(2.0 / math.pi)}
#: ``<norm>-as-<family>``: the norm with its gains initialised at ``<family>``'s output scale
SUFFIX = "-as-"


def family(norm: str) -> str:
    """``rms-half-safe`` -> ``rms``: the formula a norm computes (the part before its first ``-``)."""
    return norm.split("-", 1)[0]


def split_gain(norm: str) -> tuple[str, Optional[str]]:
    """``rms-half-safe-as-mrs`` -> ``("rms-half-safe", "mrs")``; a norm without the suffix -> ``(norm, None)``."""
    base, sep, target = norm.rpartition(SUFFIX)
    if not sep:
        return norm, None
    return base, target


def gain_factor(norm: str) -> float:
    """The factor an arm's gains start at (1 without ``-as-``): the target family's output RMS over its own.

    Raises:
        ValueError: a family without a known output scale (valid: ``OUTPUT_RMS``'s keys).
    """
    base, target = split_gain(norm)
    if target is None:
        return 1.0
    for name in (family(base), target):
        if name not in OUTPUT_RMS:
            raise ValueError(f"{norm!r}: no output scale for the family {name!r}; '-as-' takes one of "
                             f"{sorted(OUTPUT_RMS)}, after a norm of one of them (e.g. rms-half-safe-as-mrs).")
    return OUTPUT_RMS[target] / OUTPUT_RMS[family(base)]


def scale_gains(model: Any, norm_types: tuple[type, ...], factor: float) -> int:
    """Multiply the ``weight`` of every module of ``model`` that is one of ``norm_types`` by ``factor``, in place.

    Returns the number of norms scaled.

    Raises:
        ValueError: none of them has a weight (nothing to scale: the control would be the plain arm).
    """
    import torch

    scaled = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, norm_types) and getattr(module, "weight", None) is not None:
                module.weight.mul_(factor)
                scaled += 1
    if not scaled:
        raise ValueError(f"scale_gains: no norm of types {[t.__name__ for t in norm_types]} with a weight in the "
                         "model: an '-as-' arm needs affine norms.")
    return scaled
