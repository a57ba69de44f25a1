"""Norms a swap cannot see: a ``torch.fx`` graph that computes them as function calls.

A traced model (``torch.fx.symbolic_trace``, torchvision's and timm's ``create_feature_extractor``,
``timm.create_model(..., features_only=True, feature_cls="fx")``) keeps a norm as a layer only where
its tracer treats the layer as a leaf; timm's ``LayerNorm``/``LayerNorm2d`` and others are inlined as
``layer_norm``/``group_norm``/``batch_norm``/``rms_norm`` call nodes whose weights are the graph's own
attributes. No layer is left to replace, so a swap would convert nothing (or only the norms that stayed
layers) and the model would keep computing its old norms. :func:`refuse_norm_calls` refuses such a
model in one line before anything is changed: swapping the eager model first, then tracing it, is exact
(the swapped norms are single fx-wrapped nodes: :mod:`lightning_mrs.modules`).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch
from torch import nn

__all__ = ["norm_calls", "refuse_norm_calls"]

#: the bare name of a function that computes a norm: torch's and aten's (``F.layer_norm``, ``torch.rms_norm``,
#: ``aten.native_batch_norm``, ``_native_batch_norm_legit``, ``_fused_rms_norm``), timm's fast_norm
#: (``fast_layer_norm``, ``rms_norm2d``, ``simple_norm``) and this package's fx-wrapped forwards
#: (``_mrs_norm_layer``, ``_rms_norm_2d``)
_NORM_CALL = re.compile(r"^_*(?:native_|fast_|fused_)?(?:offset_)?(?:layer|group|batch|instance|rms|mrs|simple)_norm"
                        r"(?:_?2d|_layer|_legit\w*)?$")


def _name(target: Any) -> str:
    return getattr(target, "__name__", "").split(".")[0]  # an aten op's is e.g. "native_layer_norm.default"


def norm_calls(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of ``graph_module`` that compute a norm as a function call on its inputs' data.

    Only calls whose input depends on the graph's inputs count: a weight standardisation
    (``F.batch_norm`` of a convolution's weight, e.g. timm's ``ScaledStdConv2d``) is not a norm layer.
    """
    from_input: set[torch.fx.Node] = set()  # nodes computed from a placeholder (activations)
    calls = []
    for node in graph_module.graph.nodes:
        if node.op == "placeholder" or any(arg in from_input for arg in node.all_input_nodes):
            from_input.add(node)
        if node.op != "call_function" or not _NORM_CALL.match(_name(node.target)):
            continue
        data = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("x"))
        if isinstance(data, torch.fx.Node) and data in from_input:
            calls.append(node)
    return calls


def refuse_norm_calls(owner: str, model: nn.Module) -> None:
    """Raise a one-line ``ValueError`` if a ``torch.fx`` graph in ``model`` computes a norm as a function call."""
    for name, module in model.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        calls = Counter(_name(node.target) for node in norm_calls(module))
        if calls:
            shown = ", ".join(f"{count} {function}" for function, count in calls.most_common())
            raise ValueError(
                f"{owner}: {name or 'the model'} is a torch.fx GraphModule that computes {sum(calls.values())} norms "
                f"as function calls, not layers ({shown}), which no swap can replace; nothing "
                "was changed: swap the eager model first, then trace it (symbolic_trace, create_feature_extractor; "
                "for timm's features_only=True, feature_cls='fx': timm.models.FeatureGraphNet(swapped, out_indices))"
            )
