"""Norms a swap cannot see: a graph (``torch.fx``, ``torch.export``, TorchScript) that computes them inline.

A traced model (``torch.fx.symbolic_trace``, torchvision's and timm's ``create_feature_extractor``,
``timm.create_model(..., features_only=True, feature_cls="fx")``) keeps a norm as a layer only where
its tracer treats the layer as a leaf; timm's ``LayerNorm``/``LayerNorm2d`` and others are inlined as
``layer_norm``/``group_norm``/``batch_norm``/``rms_norm`` call nodes whose weights are the graph's own
attributes, and a hand-written norm (transformers' ``*RMSNorm``) as ``pow``/``mean``/``rsqrt`` nodes
(:mod:`lightning_mrs.swap.fx_arithmetic`). ``torch.export`` flattens every layer into aten ops, and
TorchScript compiles them. No layer is left to replace, so a swap would convert nothing (or only the
norms that stayed layers) and the model would keep computing its old norms.
:func:`refuse_hidden_norms` refuses such a model in one line before anything is changed: swapping the
eager model first, then tracing it, is exact (the swapped norms are single fx-wrapped nodes:
:mod:`lightning_mrs.modules`).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import torch
from torch import nn

from lightning_mrs.swap.fx_arithmetic import norm_arithmetic

__all__ = ["norm_calls", "refuse_hidden_norms"]

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


def _exported(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.export``'s: ``ExportedProgram.module()`` (a ``GraphModule`` subclass of
    aten ops) or ``torch.export.unflatten``'s module tree (``InterpreterModule`` graphs)."""
    return any(cls.__module__.startswith("torch.export") for cls in type(module).__mro__)


def _script_ops(module: torch.jit.ScriptModule) -> set[str]:
    """The ops a TorchScript module's forward runs (``layer_norm``, ``rsqrt``, ...), submodules inlined."""
    try:
        graph = module.inlined_graph
    except (AttributeError, RuntimeError):  # no forward (a scripted container): nothing runs
        return set()
    ops, blocks = set(), [graph]
    while blocks:
        for node in blocks.pop().nodes():
            ops.add(node.kind().split("::")[-1])
            blocks.extend(node.blocks())
    return ops


def _script_norms(module: torch.jit.ScriptModule) -> list[str]:
    """The ops of ``module`` that compute a norm: a norm call, or a hand-written norm's ``rsqrt``, ``var`` ..."""
    ops = _script_ops(module)
    found = {op for op in ops if _NORM_CALL.match(op) or op in ("rsqrt", "var", "var_mean", "std", "std_mean")}
    return sorted(found | ({"mean", "sqrt"} if {"mean", "sqrt"} <= ops else set()))


def refuse_hidden_norms(owner: str, model: nn.Module, body: bool = True) -> None:
    """Raise a one-line ``ValueError`` if ``model`` holds norms no swap can see, before anything is changed.

    A ``torch.fx`` graph that computes norms as function calls (:func:`norm_calls`) or as arithmetic
    (:func:`lightning_mrs.swap.fx_arithmetic.norm_arithmetic`), a ``torch.export`` module (every layer
    flattened into aten ops), and a TorchScript module whose compiled code computes a norm. A
    ``torch.compile`` module is not refused: its ``_orig_mod`` is swapped in place and dynamo's guards
    recompile it on the next call. With ``body=False`` (only QK-norms are added, the body's norms kept),
    only a ``torch.export`` module is refused: its attention layers are aten ops too, while a ``torch.fx``
    graph may keep them as layers.
    """
    fix = "nothing was changed: swap the eager model first, then"
    for name, module in model.named_modules():
        where = name or "the model"
        if _exported(module):
            raise ValueError(
                f"{owner}: {where} is a torch.export module ({type(module).__name__}), whose layers export flattened "
                f"into aten ops, so no swap can replace its norms or attention; {fix} export it "
                "(torch.export.export(swapped, args).module())"
            )
        if not body:
            continue
        if isinstance(module, torch.jit.ScriptModule) and _script_norms(module):
            raise ValueError(
                f"{owner}: {where} is a TorchScript module ({module.original_name}) whose compiled code computes "
                f"norms ({', '.join(_script_norms(module))}), which no swap can replace; {fix} script or trace it "
                "(or use torch.compile / torch.export, TorchScript's successors)"
            )
        if not isinstance(module, torch.fx.GraphModule):
            continue
        calls = Counter(_name(node.target) for node in norm_calls(module))
        arithmetic = [node.name for node in norm_arithmetic(module)]
        if calls or arithmetic:
            shown = [f"{count} {function}" for function, count in calls.most_common()]
            if arithmetic:
                nodes = ", ".join(arithmetic[:3]) + (" ..." if len(arithmetic) > 3 else "")
                plural = "s" if len(arithmetic) > 1 else ""
                shown.append(f"{len(arithmetic)} mean of squares or variance, then rsqrt/sqrt, at node{plural} {nodes}")
            how = " and ".join(kind for kind, found in (("function calls", calls), ("arithmetic", arithmetic)) if found)
            raise ValueError(
                f"{owner}: {where} is a torch.fx GraphModule that computes {sum(calls.values()) + len(arithmetic)} "
                f"norms as {how}, not layers ({', '.join(shown)}), which no swap can replace; {fix} trace it "
                "(symbolic_trace, create_feature_extractor; for timm's features_only=True, feature_cls='fx': "
                "timm.models.FeatureGraphNet(swapped, out_indices))"
            )
