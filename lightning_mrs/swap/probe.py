"""Recognise a norm layer by what it computes: a float64 probe against the RMS and LayerNorm formulas.

The registry (:mod:`lightning_mrs.swap.registry`) knows the norm classes of torch, timm and
torchvision by name. Every other model family writes its own ``RMSNorm`` (Llama, Qwen, Gemma's
``(1 + weight)``, OLMo's weightless LayerNorm, ...), and new ones appear every month. A module
the registry does not know is a *candidate* when it is a leaf whose only parameters are a 1-d
``weight`` (and a ``bias`` of the same size), and its class name contains ``Norm`` or it has an
``eps``-like attribute (``eps``, ``variance_epsilon``, ...); a leaf named ``*Norm*`` with no
parameters is one too. :func:`probe_norm` then runs the module's own ``forward`` (no hooks) on
a shallow copy holding float64 random weights, on a float64 ``(2, 3, C)`` input whose rows
have scales from ``3`` down to ``1e-4`` and a non-zero mean, and compares the output with

    ``n(x) * s + b``,  ``n`` = RMS (``x / sqrt(mean(x^2) + eps)``) or LayerNorm
    (``(x - mean) / sqrt(var + eps)``) over the last dim; ``s`` = ``w``, ``1 + w``, or none;
    ``b`` = the bias when the module has one.

``eps`` is the module's attribute when it has one, else read off the smallest row (where it
matters most) and verified on all rows. The layer is replaced only when exactly one formula
matches to :data:`TOLERANCE` (relative to the output's scale); otherwise the swap skips it with
the reason and the error of the nearest formula.

The probe never depends on where the model lives: it runs on the CPU in float64 whatever the
module's device (``meta`` included) or the default device and dtype (``torch.device("meta")``,
``torch.set_default_device("cuda")``, transformers' ``dtype=`` loading), and through the class's
``forward``, never an instance's (accelerate's hooks replace ``module.forward`` on the instance).
A module whose ``forward`` takes more than its input (a gated norm, ``forward(h, gate=None)``) is
not probed: a replacement would drop the other inputs. A verdict is cached per instance, except
one that came from an exception.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class OffsetRMSNorm(nn.Module):  # Gemma's style: the weight is an offset from 1
    ...     def __init__(self, dim):
    ...         super().__init__()
    ...         self.weight, self.eps = nn.Parameter(torch.zeros(dim)), 1e-6
    ...     def forward(self, x):
    ...         return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)
    >>> str(probe_norm(OffsetRMSNorm(8), 8).formula)
    'rms(x) * (1 + w), eps=1e-06'
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

__all__ = ["Formula", "Probe", "TOLERANCE", "extra_inputs", "looks_like_norm", "probe_norm", "recognise"]

#: the largest max error (relative to the output's largest value) of a matching formula. A
#: module computing in float32 internally is off by ~1e-7; the nearest wrong formula by > 1e-2.
TOLERANCE = 1e-4
EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "variance_eps", "norm_eps", "layer_norm_eps")
_SIZE_ATTRS = ("normalized_shape", "hidden_size", "num_features", "num_channels", "dim", "d_model")
_ROW_SCALES = (1.0, 3.0, 0.1, 1e-2, 1e-3, 1e-4)  # (2, 3, C) input: 6 rows; the last row fixes eps
_WEIGHTS = ("w", "1+w")  # how a weight scales the normalised x: y = n * w, or n * (1 + w)


@dataclass(frozen=True)
class Formula:
    """What a probed norm computes over the last dim: ``n(x) * scale + bias``.

    Attributes:
        kind: ``"rms"`` or ``"layer"`` (mean removed).
        weight: ``"w"`` (scale = weight), ``"1+w"`` (Gemma, Nemotron: an offset from 1) or
            ``"none"`` (no weight: OLMo's LayerNorm).
        bias: a bias is added after the scale.
        eps: the epsilon inside the root.
    """

    kind: str
    weight: str
    bias: bool
    eps: float

    def scale(self, weight: Optional[Tensor]) -> Optional[Tensor]:
        """The effective per-channel scale of ``weight`` (``1 + w`` for an offset layer)."""
        if weight is None or self.weight == "none":
            return None
        return 1 + weight if self.weight == "1+w" else weight

    def __call__(self, x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None) -> Tensor:
        """The formula itself (the probe's reference), computed in ``x``'s dtype."""
        if self.kind == "layer":
            x = x - x.mean(dim=-1, keepdim=True)
        y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., C)
        scale = self.scale(weight)
        y = y if scale is None else y * scale
        return y + bias if self.bias and bias is not None else y

    def __str__(self) -> str:
        scale = {"w": " * w", "1+w": " * (1 + w)", "none": ""}[self.weight]
        return f"{self.kind}(x){scale}{' + b' if self.bias else ''}, eps={self.eps:g}"


@dataclass(frozen=True)
class Probe:
    """The outcome of :func:`probe_norm`: the matching formula, or why there is none."""

    formula: Optional[Formula]
    error: float  # the max relative error of the nearest formula (``inf``: the forward failed)
    reason: Optional[str] = None


def _eps_attr(module: nn.Module) -> Optional[float]:
    for attr in EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return None


def _clone(module: nn.Module, gen: torch.Generator) -> nn.Module:
    """A shallow copy of ``module`` (same class and attributes, its own tensors): float64 CPU
    random weights (``0.5..1.5``), biases (``-0.5..0.5``) and buffers; meta tensors are fine."""
    clone = copy.copy(module)

    def fresh(t: Tensor, low: float, high: float) -> Tensor:
        return torch.empty(t.shape, dtype=torch.float64, device="cpu").uniform_(low, high, generator=gen)

    params = {n: None if p is None else nn.Parameter(fresh(p, 0.5, 1.5) if n == "weight" else fresh(p, -0.5, 0.5),
                                                     requires_grad=False)
              for n, p in module._parameters.items()}
    buffers = {n: None if b is None else (fresh(b, 0.5, 1.5) if b.is_floating_point() else
                                          torch.zeros(b.shape, dtype=b.dtype, device="cpu"))
               for n, b in module._buffers.items()}
    object.__setattr__(clone, "_parameters", params)
    object.__setattr__(clone, "_buffers", buffers)
    return clone


def _probe_input(channels: int, gen: torch.Generator) -> Tensor:
    scales = torch.tensor(_ROW_SCALES, dtype=torch.float64, device="cpu").view(2, 3, 1)
    x = torch.randn(2, 3, channels, dtype=torch.float64, device="cpu", generator=gen) + 0.5  # a mean: RMS != LayerNorm
    return x * scales  # (2, 3, C)


@contextlib.contextmanager
def cpu_float64() -> Iterator[None]:
    """Tensors created inside (by the probe or the probed forward) default to CPU float64,
    whatever default device (``torch.device("meta")``, ``set_default_device``) or dtype is set."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def extra_inputs(module: nn.Module) -> list[str]:
    """The parameters of ``type(module).forward`` besides ``self`` and the input: a norm's
    forward takes only its input (``forward(h, gate=None)`` is a gated norm)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):  # a builtin forward: no signature to read
        return []
    if not params or params[0].kind is inspect.Parameter.VAR_POSITIONAL:
        return []  # forward(self, *args): nothing to read
    return [p.name for p in params[1:]]


def looks_like_norm(module: nn.Module) -> bool:
    """The one by-name rule of the project: a module whose class name says ``Norm``, outside
    torch's weight parametrizations (``torch.nn.utils``: weight/spectral norm normalise weights).

    The swap (a probe candidate), the monitors (a module to watch or to name as unwatchable)
    and the recipes (what a model's norms are called) all use it.
    """
    cls = type(module)
    return "Norm" in cls.__name__ and not cls.__module__.startswith("torch.nn.utils")


def _estimate_eps(formula: Formula, x: Tensor, y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> float:
    """``eps`` from the smallest row: ``x_c / n = sqrt(mean(x_c^2) + eps)`` (``x_c`` centred for
    LayerNorm), rounded to 3 significant digits; 0 when below what the row can resolve."""
    xr, yr = x[-1, -1], y[-1, -1]  # the 1e-4 row: (C,)
    if formula.bias and bias is not None:
        yr = yr - bias
    scale = formula.scale(weight)
    n = yr if scale is None else yr / scale
    if formula.kind == "layer":
        xr = xr - xr.mean()
    ms = float(xr.pow(2).mean())
    denom = float(xr @ n)
    if not denom > 0:
        return 0.0
    eps = (float(xr @ xr) / denom) ** 2 - ms
    return float(f"{eps:.3g}") if eps > 1e-4 * ms else 0.0


def probe_norm(module: nn.Module, channels: int, eps: Optional[float] = None) -> Probe:
    """What ``module`` computes over the last dim of size ``channels``, found by running it.

    Args:
        module: a leaf module; it is not changed, its hooks do not run (its class's ``forward``
            runs on a CPU float64 copy).
        channels: the size of the normalised last dim.
        eps: the epsilon to assume first (else the module's ``eps``-like attribute); the one
            read off the probe is tried next.

    Returns:
        A :class:`Probe`: the single matching :class:`Formula`, or ``None`` and the reason.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        with cpu_float64(), torch.no_grad():
            clone = _clone(module, gen)
            x = _probe_input(channels, gen)
            y = type(module).forward(clone, x)  # the class's forward: never a per-instance one (accelerate)
    except Exception as err:  # noqa: BLE001 - any failure means "not a last-dim norm we can read"
        return Probe(None, math.inf, f"its forward fails on a float64 (2, 3, {channels}) input "
                                     f"({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})")
    if not isinstance(y, Tensor) or y.shape != x.shape or not y.is_floating_point():
        what = f"shape {tuple(y.shape)}" if isinstance(y, Tensor) else type(y).__name__
        return Probe(None, math.inf, f"returns {what} for a (2, 3, {channels}) input, not a tensor of that shape")
    y = y.detach().to(torch.float64)
    weight, bias = clone._parameters.get("weight"), clone._parameters.get("bias")
    has_bias = bias is not None
    first = _eps_attr(module) if eps is None else eps
    matches: list[tuple[float, Formula]] = []
    nearest: tuple[float, Optional[Formula]] = (math.inf, None)
    for kind in ("rms", "layer"):
        for mode in _WEIGHTS if weight is not None else ("none",):
            guess = Formula(kind, mode, has_bias, 0.0)
            tried = [first] if first is not None else []
            tried.append(_estimate_eps(guess, x, y, weight, bias))
            for e in dict.fromkeys(tried):
                formula = Formula(kind, mode, has_bias, e)
                ref = formula(x, weight, bias)
                err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                if not math.isfinite(err):
                    continue
                if err < nearest[0]:
                    nearest = (err, formula)
                if err <= TOLERANCE:
                    matches.append((err, formula))
                    break
    if len(matches) == 1:
        return Probe(matches[0][1], matches[0][0])
    if matches:
        found = "; ".join(str(f) for _, f in matches)
        return Probe(None, min(e for e, _ in matches), f"matches several formulas ({found}): ambiguous")
    near = f"; nearest: {nearest[1]}" if nearest[1] is not None else ""
    return Probe(None, nearest[0], "computes neither RMS nor LayerNorm over the last dim "
                                   f"(max error {nearest[0]:.2g}{near})")


def _channels(module: nn.Module) -> Optional[int]:
    for name in ("weight", "bias"):
        param = module._parameters.get(name)
        if param is not None and param.ndim == 1:
            return int(param.shape[0])
    for attr in _SIZE_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (tuple, list, torch.Size)) and len(value) == 1:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _structure(module: nn.Module) -> tuple[bool, Optional[str]]:
    """``(is a candidate, why it cannot be a last-dim norm)`` from the module's attributes only."""
    if module._modules:
        return False, None  # a container: its children are looked at on their own
    named = looks_like_norm(module)
    params = {n: p for n, p in module._parameters.items() if p is not None}
    weight, bias = params.get("weight"), params.get("bias")
    if not params:
        extra = extra_inputs(module) if named else []
        return named, (f"its forward takes more than the input ({', '.join(extra)}); not swapped" if extra else None)
    if set(params) - {"weight", "bias"} or weight is None:
        what = ", ".join(f"{n} {tuple(p.shape)}" for n, p in params.items())
        return named, f"not a norm over the last dim with a 1-d weight: its parameters are {what}"
    if weight.ndim != 1 or (bias is not None and bias.shape != weight.shape):
        what = ", ".join(f"{n} {tuple(p.shape)}" for n, p in params.items())
        return named, f"not a norm over the last dim with a 1-d weight: its parameters are {what}"
    candidate = named or _eps_attr(module) is not None
    extra = extra_inputs(module) if candidate else []
    if extra:
        return True, (f"its forward takes more than the input ({', '.join(extra)}): a gated norm, which a "
                      "replacement taking only the input would change; not swapped")
    return candidate, None


_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple[Optional[float], tuple[int, Optional[Formula], Optional[str]]]]" = (
    weakref.WeakKeyDictionary())


def recognise(module: nn.Module, eps: Optional[float] = None,
              expected: Optional[tuple[str, str]] = None) -> Optional[tuple[int, Optional[Formula], Optional[str]]]:
    """``(channels, formula, reason)`` for a module that looks like a norm, else ``None``.

    ``formula`` is what the probe found (``None`` with the ``reason`` when nothing matched or the
    module cannot be probed). ``eps`` is a known epsilon to try first; ``expected`` a known
    ``(kind, weight)`` the probe must confirm (a class of transformers whose code was read).
    Results are cached per module instance (not those of a forward that raised).
    """
    candidate, reason = _structure(module)
    if not candidate and expected is None:
        return None
    hit = _CACHE.get(module)
    if hit is not None and hit[0] == _eps_attr(module):
        return hit[1]  # a second lookup (every iter_norm_layers call) costs no forward
    channels = _channels(module)
    if reason is None and channels is None:
        # a weightless norm works at any width: say what it computes, though nothing can be built
        width_free = probe_norm(module, 8, eps).formula
        what = f"computes {width_free}, but" if width_free is not None else "a weightless module that"
        reason = (f"{what} has no weight, normalized_shape or hidden_size to tell its width, which the "
                  "replacement needs")
    formula, failed = None, False
    if reason is None:
        probe = probe_norm(module, channels, eps)
        formula, reason = probe.formula, probe.reason
        failed = formula is None and probe.error == math.inf  # an exception: maybe transient, never cached
        if formula is not None and expected is not None and (formula.kind, formula.weight) != expected:
            reason = (f"the probe found {formula}, but {type(module).__qualname__} is known to compute "
                      f"{Formula(expected[0], expected[1], formula.bias, formula.eps)}; not swapped (report this)")
            formula = None
    if formula is None and expected is None and not looks_like_norm(module):
        result = None  # only its eps attribute made it a candidate: not a norm after all
    else:
        result = (channels or 0, formula, reason)
    if not failed:
        _CACHE[module] = (_eps_attr(module), result)
    return result
