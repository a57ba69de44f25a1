"""Where a pure half-precision run breaks: the residual stream's largest ``|x|`` per layer and step.

:class:`ResidualTrace` puts a forward pre-hook on every body norm of a decoder (for a Llama the
``input_layernorm`` and ``post_attention_layernorm`` of each layer and the final ``norm``): a norm's
input *is* the residual stream at that point (before layer i's attention, before its MLP, after the
last layer), in the model's dtype. A forward hook on the output head adds the logits. In every
training step's forward it records ``max |x|`` at each point, in forward order, until the first step
in which a point is non-finite (that step included): :attr:`first_nonfinite` is that step and the
first point in forward order that was non-finite, the layer that overflowed first (the embedding's
output, ``L0.attn``, non-finite means the weights were already NaN: the failure came from a backward
or an optimizer step, not from the forward's growth). Imports torch only when a cell traces.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=2,
    ...                                      num_attention_heads=2, intermediate_size=16))
    >>> trace = ResidualTrace(model)
    >>> trace.points
    ['L0.attn', 'L0.mlp', 'L1.attn', 'L1.mlp', 'final', 'logits']
    >>> _ = model.train()(torch.tensor([[1, 2, 3]]))
    >>> sorted(trace.steps[0]) == sorted(trace.points), trace.first_nonfinite
    (True, None)
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:  # no torch at import: recipes.sweeps.p1t thins its trace with kept_steps
    from torch import Tensor, nn

__all__ = ["ResidualTrace", "kept_steps", "trace_callback"]

#: a decoder layer's norm -> the point of the residual stream its input is
_POINTS = {"input_layernorm": "attn", "post_attention_layernorm": "mlp", "ln_1": "attn", "ln_2": "mlp"}
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.(\w+)$")
#: the final norm's and the head's names (Llama-like, GPT-2-like)
_FINAL, _HEAD = ("norm", "ln_f"), ("lm_head",)


def kept_steps(steps: Iterable[int], every: int, first_nonfinite: Optional[int], last: int = 3) -> set[int]:
    """Every ``every``-th, the ``last`` and the first non-finite of ``steps`` (the rise to the overflow kept whole)."""
    steps = sorted(steps)
    return {s for s in steps if s % every == 0} | set(steps[-last:]) | ({first_nonfinite} - {None})


class ResidualTrace:
    """Forward hooks recording ``max |x|`` of the residual stream per point and training step.

    Attributes:
        points: the recorded points in forward order (``L<i>.attn``, ``L<i>.mlp``, ``final``, ``logits``).
        steps: step -> point -> largest ``|x|`` in that step's (first) training forward.
        first_nonfinite: ``(step, point)`` of the first non-finite value, or ``None``.

    Raises:
        ValueError: the model has no decoder-layer norm under a known name (nothing would be traced).
    """

    def __init__(self, model: nn.Module) -> None:
        self.points: list[str] = []
        self.steps: dict[int, dict[str, float]] = {}
        self.first_nonfinite: Optional[tuple[int, str]] = None
        self.step = 0  # the trainer's global step, set before each training batch
        self._handles = []
        for name, module in model.named_modules():
            point = self._point(name)
            if point is None:
                continue
            self.points.append(point)
            if point == "logits":
                self._handles.append(module.register_forward_hook(self._output_hook(point)))
            else:
                self._handles.append(module.register_forward_pre_hook(self._input_hook(point)))
        if not any(p.startswith("L") for p in self.points):
            raise ValueError(f"ResidualTrace: no decoder-layer norm ({', '.join(_POINTS)}) in "
                             f"{type(model).__name__}: nothing to trace.")

    @staticmethod
    def _point(name: str) -> Optional[str]:
        match = _LAYER.search(name)
        if match and match.group(2) in _POINTS:
            return f"L{match.group(1)}.{_POINTS[match.group(2)]}"
        last = name.rsplit(".", 1)[-1]
        if last in _FINAL and "layers." not in name and ".h." not in name:
            return "final"
        return "logits" if last in _HEAD else None

    def _record(self, point: str, x: Tensor) -> None:
        import torch
        if not torch.is_grad_enabled() or self.first_nonfinite is not None and self.step > self.first_nonfinite[0]:
            return  # validation, or after the first non-finite step
        values = self.steps.setdefault(self.step, {})
        if point in values:  # a second forward in the same step (none in these cells): keep the first
            return
        value = float(x.detach().abs().amax())  # Inf stays Inf, NaN stays NaN
        values[point] = value
        if self.first_nonfinite is None and not math.isfinite(value):
            self.first_nonfinite = (self.step, point)

    def _input_hook(self, point: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            self._record(point, args[0])
        return hook

    def _output_hook(self, point: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
            self._record(point, output)
        return hook

    def rows(self, every: int = 10, last: int = 3) -> list[dict[str, Any]]:
        """Tidy rows ``{"step", "point", "absmax"}`` of the steps :func:`kept_steps` keeps."""
        kept = kept_steps(self.steps, every, self.first_nonfinite and self.first_nonfinite[0], last)
        return [{"step": s, "point": p, "absmax": self.steps[s][p]} for s in sorted(kept)
                for p in self.points if p in self.steps[s]]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def trace_callback(trace: ResidualTrace) -> Any:
    """A Lightning callback that tells ``trace`` the global step before every training batch."""
    import lightning.pytorch as pl

    class _Steps(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            trace.step = trainer.global_step

    return _Steps()
