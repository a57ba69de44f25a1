"""The mechanism stress of :mod:`recipes.sweeps.claims.mechanism`, run on one trained model: imports torch.

:func:`mechanism_rows` takes a ``ByteLM`` trained in fp32 with RMSNorm or MRSNorm and returns the rows
of ``mechanism.csv`` for it: the model as trained and with its norms computed in float16
(``rms-half``/``mrs-half`` and ``rms-half-safe``/``mrs-half-safe``, :mod:`lightning_mrs.swap.half`), each cast to float16, evaluated on the
validation windows with channel :data:`~recipes.sweeps.claims.mechanism.CHANNEL` of every norm's input set to
each planted magnitude. The model itself is not changed (every arm works on a copy).
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_mrs import swap_norms
from lightning_mrs.swap.registry import iter_norm_layers
from recipes.sweeps.claims.mechanism import ARMS, CHANNEL, MAGNITUDES

__all__ = ["mechanism_rows", "stress_model"]


class _Plant:
    """Forward hooks on every norm: the planted channel in, broken output tokens counted out."""

    def __init__(self, norms: list[nn.Module], magnitude: float) -> None:
        self.magnitude = magnitude
        self.tokens = self.nonfinite = self.zero = 0
        self.handles = [h for n in norms for h in (n.register_forward_pre_hook(self._plant),
                                                   n.register_forward_hook(self._count))]

    def _plant(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        if not self.magnitude:
            return None
        x = args[0].clone()  # (..., C): the residual stream itself stays as it was
        x[..., CHANNEL] = self.magnitude
        return (x, *args[1:])

    def _count(self, module: nn.Module, args: tuple[Any, ...], y: Tensor) -> None:
        tokens = y.reshape(-1, y.shape[-1])  # (T, C)
        nonfinite = ~torch.isfinite(tokens).all(-1)  # (T,)
        zero = (tokens == 0).all(-1)  # (T,)
        self.tokens += tokens.shape[0]
        self.nonfinite += int(nonfinite.sum())
        self.zero += int((zero & ~nonfinite).sum())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def stress_model(model: nn.Module, arm: str) -> nn.Module:
    """A float16 copy of a transformers causal LM, its norms swapped to ``arm``'s (``*-half``) or kept."""
    copied = copy.deepcopy(model)
    if arm not in ("rms", "mrs"):  # a half-precision baseline: the swap target of that name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = swap_norms(copied, arm)
        if not report.converted:
            raise RuntimeError(f"mechanism stress: swap_norms(target={arm!r}) converted no norm: {report}")
    return copied.half().eval()


@torch.no_grad()
def mechanism_rows(model: nn.Module, windows: Tensor, norm: str, cell: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``mechanism.csv`` for one trained model.

    Args:
        model: the transformers causal LM (``ByteLM.model``), trained with ``norm``.
        windows: the validation windows, ``(W, T + 1)`` bytes.
        norm: ``rms`` or ``mrs``: the arms evaluated are ``norm``, ``norm-half`` and ``norm-half-safe``.
        cell: the cell's columns every row carries (``lr``, ``batch_size``, ``seed``).
    """
    rows = []
    idx, target = windows[:, :-1].long(), windows[:, 1:].long().flatten()  # (W, T), (W * T,)
    for arm in (a for a, src in ARMS.items() if src == norm):
        half = stress_model(model, arm)
        norms = [m for _, m, spec in iter_norm_layers(half) if spec.unsupported is None]
        for magnitude in (0.0, *MAGNITUDES):
            plant = _Plant(norms, magnitude)
            try:
                logits = half(input_ids=idx, use_cache=False).logits  # (W, T, 256) float16
            finally:
                plant.remove()
            nats = F.cross_entropy(logits.float().flatten(0, 1), target)
            rows.append({"norm": norm, "arm": arm, **cell, "magnitude": magnitude, "val_bpb": float(nats) / math.log(2),
                         "bad_frac": (plant.nonfinite + plant.zero) / plant.tokens,
                         "nonfinite_frac": plant.nonfinite / plant.tokens, "zero_frac": plant.zero / plant.tokens,
                         "norm_tokens": plant.tokens})
    return rows
