"""``init="calibrate"``: new norm weights fitted so that a trained model keeps what it computes.

RMSNorm's ``rms(x)`` and MRSNorm's ``mean_i r_i`` differ by a factor that depends on the input,
so ``init="inherit"`` (the old weights, pair means for MRS) moves a trained model's outputs as
soon as its norms are swapped. Calibration runs the model on data the user gives and, layer by
layer in forward order, fits each new layer's affine weights by least squares so that its output
matches the target on the inputs the already-converted model gives it:

* a replaced norm's target is what the *old* layer computes on that same input (the old layer is
  kept aside for this); an added QK-norm's target is its own input, the un-normed per-head
  queries or keys it was inserted in front of (they had no norm);
* the fit is closed form per weight: with ``u`` the new layer's output at unit weight and zero
  bias, each weight ``g`` (one per channel, one per phasor for MRSNorm, whose two channels share
  it) minimises ``sum (t - g u)^2`` over every token (and position) of the calibration data:
  ``g = sum(u t) / sum(u u)``; a layer with a bias (LayerNorm) fits ``(g, b)`` per channel, an
  intercept regression. A bias of the old layer that the new one cannot hold (MRSNorm has none)
  is part of the residual the report gives.

The calibration data is a tensor (``model(batch)``), a dict (``model(**batch)``) or a callable
that runs the model (``calibration(model)``). The model runs in eval mode without gradients
(BatchNorm with its running statistics): once unswapped (data it cannot run is refused before
anything changes), once to find the forward order, then once per calibrated layer (a pass stops
at the layer when the data is a tensor or dict); training flags are restored afterwards.

The report (``report.calibration``) gives, per layer, the relative output error
``||y - t|| / ||t||`` with the inherited weights and with the fitted ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_mrs.modules import MRSNorm, MRSNorm2d
from lightning_mrs.swap.layers import NormAct, OffsetRMSNorm
from lightning_mrs.swap.registry import norm_spec

__all__ = ["Calibration", "calibrate", "check_calibration", "check_runs", "run_calibration"]

Calibration = Union[Tensor, dict, Callable[[nn.Module], Any]]


class _Stop(Exception):
    """Raised by a calibration hook once its layer has seen the whole batch: the rest is not run."""


def check_calibration(calibration: Any) -> None:
    """Raise a ``TypeError`` unless ``calibration`` is a tensor, a dict or a callable."""
    if not isinstance(calibration, (Tensor, dict)) and not callable(calibration):
        raise TypeError(
            f"swap_norms(init='calibrate'): calibration must be a tensor (model(batch)), a dict (model(**batch)) or "
            f"a callable that runs the model, got {type(calibration).__name__}.")


def run_calibration(model: nn.Module, calibration: Calibration) -> None:
    """Run ``model`` on the calibration data (a tensor, a dict of keyword tensors, or a callable)."""
    if isinstance(calibration, dict):
        model(**calibration)
    elif isinstance(calibration, Tensor):
        model(calibration)
    else:
        calibration(model)


@dataclass
class _Fit:
    """Least-squares sums of one layer, per channel (float64)."""

    name: str
    layer: nn.Module
    target: Callable[[Tensor], Tensor]  # the layer's input -> what its output should be
    calls: int = 0
    sums: dict[str, Tensor] = field(default_factory=dict)

    def add(self, u: Tensor, t: Tensor, channel_dim: int) -> None:
        dims = [d for d in range(u.ndim) if d != channel_dim % u.ndim]
        u, t = u.double(), t.double()
        parts = {"ut": u * t, "uu": u * u, "tt": t * t, "u": u, "t": t}
        for key, value in parts.items():
            total = value.sum(dim=dims)  # (C,)
            self.sums[key] = self.sums[key] + total if key in self.sums else total
        n = torch.tensor(float(u.numel() // u.shape[channel_dim]), dtype=torch.float64, device=u.device)
        self.sums["n"] = self.sums.get("n", 0) + n
        self.calls += 1


def _affine(layer: nn.Module) -> tuple[Optional[Tensor], Optional[Tensor], float]:
    """The layer's weight, bias and weight offset (``OffsetRMSNorm`` stores ``scale - offset``)."""
    weight, bias = getattr(layer, "weight", None), getattr(layer, "bias", None)
    offset = layer.offset if isinstance(layer, OffsetRMSNorm) else 0.0
    return (weight if isinstance(weight, Tensor) else None, bias if isinstance(bias, Tensor) else None, offset)


def _unit_output(layer: nn.Module, x: Tensor) -> Tensor:
    """The layer's output at unit scale and zero bias (its normalised input)."""
    weight, bias, offset = _affine(layer)
    saved = [t.detach().clone() if t is not None else None for t in (weight, bias)]
    try:
        if weight is not None:
            weight.data.fill_(1.0 - offset)
        if bias is not None:
            bias.data.zero_()
        return type(layer).forward(layer, x)  # not through __call__: the calibration hook is on this layer
    finally:
        if weight is not None:
            weight.data.copy_(saved[0])
        if bias is not None:
            bias.data.copy_(saved[1])


def _solve(fit: _Fit, paired: bool) -> tuple[Tensor, Optional[Tensor]]:
    """The fitted effective scale per channel and, for a layer with a bias, the bias."""
    s = fit.sums
    _, bias, _ = _affine(fit.layer)
    if bias is not None:  # per channel: t = g u + b
        n = s["n"]
        var = s["uu"] - s["u"] * s["u"] / n
        g = torch.where(var > 0, (s["ut"] - s["u"] * s["t"] / n) / var.clamp_min(1e-300), torch.ones_like(var))
        return g, (s["t"] - g * s["u"]) / n
    if paired:  # one weight per phasor: both channels of a pair share it
        ut, uu = s["ut"].reshape(-1, 2).sum(1), s["uu"].reshape(-1, 2).sum(1)
        g = torch.where(uu > 0, ut / uu.clamp_min(1e-300), torch.ones_like(uu))
        return g.repeat_interleave(2), None
    return torch.where(s["uu"] > 0, s["ut"] / s["uu"].clamp_min(1e-300), torch.ones_like(s["uu"])), None


def _error(fit: _Fit, g: Tensor, b: Optional[Tensor]) -> float:
    """``||g u + b - t|| / ||t||`` from the sums."""
    s = fit.sums
    sq = s["tt"] - 2 * g * s["ut"] + g * g * s["uu"]
    if b is not None:
        sq = sq + s["n"] * b * b - 2 * b * s["t"] + 2 * g * b * s["u"]
    return float(sq.sum().clamp_min(0).sqrt() / s["tt"].sum().sqrt().clamp_min(1e-300))


def _current(fit: _Fit, channels: int, paired: bool) -> tuple[Tensor, Optional[Tensor]]:
    weight, bias, offset = _affine(fit.layer)
    if weight is None:
        return torch.ones(channels, dtype=torch.float64), None
    g = weight.detach().double().cpu() + offset
    return (g.repeat_interleave(2) if paired else g), (bias.detach().double().cpu() if bias is not None else None)


@torch.no_grad()
def _set(layer: nn.Module, g: Tensor, b: Optional[Tensor], paired: bool) -> None:
    weight, bias, offset = _affine(layer)
    scale = g.reshape(-1, 2)[:, 0] if paired else g  # (P,) or (C,): the pair's shared weight
    weight.copy_((scale - offset).to(weight.dtype))
    if bias is not None and b is not None:
        bias.copy_(b.to(bias.dtype))


@torch.no_grad()
def calibrate(model: nn.Module, layers: list[tuple[str, nn.Module, Callable[[Tensor], Tensor]]],
              calibration: Calibration) -> dict[str, tuple[float, float]]:
    """Fit the affine weights of ``layers`` (``(name, new layer, target of its input)``) in
    forward order; return ``name -> (relative error inherited, relative error fitted)``.

    Raises:
        ValueError: the model cannot run the calibration data.
    """
    training = {m: m.training for m in model.modules()}
    results: dict[str, tuple[float, float]] = {}
    try:
        model.eval()
        order = _forward_order(model, layers, calibration)
        for name in order:
            layer, target = next((m, t) for n, m, t in layers if n == name)
            norm = layer.norm if isinstance(layer, NormAct) else layer
            spec = norm_spec(norm)
            weight, _, _ = _affine(norm)
            if spec is None or weight is None:
                continue
            paired = isinstance(norm, (MRSNorm, MRSNorm2d))
            fit = _Fit(name, norm, target)
            stoppable = isinstance(calibration, (Tensor, dict))  # a user's callable is never interrupted

            def hook(module: nn.Module, args: Any, output: Tensor, fit: _Fit = fit, calls: int = order[name]) -> None:
                x = args[0]
                fit.add(_unit_output(module, x), fit.target(x), spec.channel_dim)
                if stoppable and fit.calls >= calls:
                    raise _Stop

            handle = norm.register_forward_hook(hook)
            try:
                run_calibration(model, calibration)
            except _Stop:
                pass
            finally:
                handle.remove()
            channels = spec.num_channels
            g0, b0 = _current(fit, channels, paired)
            g, b = _solve(fit, paired)
            before, after = _error(fit, g0.to(g), b0.to(g) if b0 is not None else None), _error(fit, g, b)
            if after < before:  # the fit cannot do worse on its own data; equal means nothing to gain
                _set(norm, g, b, paired)
            results[name] = (before, min(before, after))
    finally:
        for module, flag in training.items():
            module.training = flag
    return results


def _run_or_explain(model: nn.Module, calibration: Calibration) -> None:
    try:
        run_calibration(model, calibration)
    except Exception as err:  # noqa: BLE001 - any failure of the user's data or model: one line naming it
        first = str(err).splitlines()[0][:160] if str(err) else ""
        raise ValueError(
            f"swap_norms(init='calibrate'): the model cannot run the calibration data ({type(err).__name__}: {first}); "
            "pass what the model takes: a tensor (model(batch)), a dict (model(**batch)) or a callable that runs it"
        ) from err


@torch.no_grad()
def check_runs(model: nn.Module, calibration: Calibration) -> None:
    """Run the unswapped model once on the calibration data (eval mode, flags restored), so that
    data it cannot run is refused before the swap changes anything."""
    check_calibration(calibration)
    training = {m: m.training for m in model.modules()}
    try:
        _run_or_explain(model.eval(), calibration)
    finally:
        for module, flag in training.items():
            module.training = flag


def _forward_order(model: nn.Module, layers: list[tuple[str, nn.Module, Callable]], calibration: Calibration) -> dict[str, int]:
    """The layers in the order the forward first calls them -> how many calls one run makes."""
    calls: dict[str, int] = {}
    handles = []
    for name, layer, _ in layers:
        def count(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
            calls[name] = calls.get(name, 0) + 1
        handles.append((layer.norm if isinstance(layer, NormAct) else layer).register_forward_hook(count))
    try:
        _run_or_explain(model, calibration)
    finally:
        for handle in handles:
            handle.remove()
    return calls
