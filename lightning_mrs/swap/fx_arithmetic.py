"""Norms a traced graph computes as arithmetic: a hand-written RMSNorm or LayerNorm that tracing inlined.

transformers' ``LlamaRMSNorm`` (and each family's copy: T5's, Gemma's ``1 + w``) computes
``x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)``; a hand-written LayerNorm computes
``(x - u) / torch.sqrt((x - u).pow(2).mean(-1, keepdim=True) + eps)``, or divides by ``x.std(-1)``. In an
eager model the probe (:mod:`lightning_mrs.swap.probe`) recognises such a layer by running it; once
``torch.fx.symbolic_trace`` (or ``make_fx``) has inlined it, only ``pow``/``mean``/``rsqrt`` nodes are
left and no layer to replace. :func:`norm_arithmetic` finds them by their shape: a second moment of an
activation (the ``mean`` of its square, ``var``, ``var_mean``), through ``+ eps`` and casts, to an
``rsqrt``/``sqrt`` (or a ``std``) that multiplies or divides that same activation. A root mean square
that scales nothing (a loss, an RMS metric) is not a norm, nor is ``F.normalize`` (an L2 ``norm``).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.fx import Node

__all__ = ["norm_arithmetic"]

_CASTS = {"to", "float", "double", "half", "bfloat16", "type", "type_as", "_to_copy", "contiguous", "clone", "alias",
          "expand", "expand_as"}
_EPS = _CASTS | {"add", "add_", "iadd", "clamp", "clamp_", "clamp_min", "clamp_min_"}  # moment -> rsqrt/sqrt
_TO_SCALE = _CASTS | {"add", "add_", "iadd", "reciprocal"}  # rsqrt/sqrt -> the multiply or divide
_SCALE = {"mul", "mul_", "imul", "div", "div_", "truediv", "itruediv"}
_ELEMENTWISE = _CASTS | _SCALE | {"sub", "sub_", "add", "add_", "neg"}  # what a scaled activation is made with


def _op(node: Any) -> str:
    """The bare operation name of ``node``: ``"pow"`` for ``x.pow``, ``torch.pow``, ``operator.pow`` and
    ``aten.pow.Tensor_Scalar``."""
    if not isinstance(node, Node):
        return ""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", "").split(".")[0]
    return ""


def _squared(node: Node) -> Optional[Node]:
    """What ``node`` squares (``x.pow(2)``, ``x ** 2``, ``x.square()``, ``x * x``), else ``None``."""
    op, args = _op(node), node.args
    if op in ("pow", "pow_") and len(args) >= 2 and isinstance(args[0], Node) and args[1] == 2:
        return args[0]
    if op == "square" and args and isinstance(args[0], Node):
        return args[0]
    if op in ("mul", "mul_") and len(args) == 2 and isinstance(args[0], Node) and args[0] is args[1]:
        return args[0]
    return None


def _moment(node: Node) -> Optional[tuple[Node, bool]]:
    """``(the activation, already a root)`` if ``node`` is its second moment (or, already rooted, its ``std``)."""
    op, args = _op(node), node.args
    if op == "mean" and args and isinstance(args[0], Node):
        base = _squared(args[0])
        return None if base is None else (base, False)
    if op in ("var", "std") and args and isinstance(args[0], Node):
        return args[0], op == "std"
    if op == "getitem" and len(args) == 2 and args[1] == 0 and _op(args[0]) in ("var_mean", "std_mean"):
        source = args[0]
        return (source.args[0], _op(source) == "std_mean") if isinstance(source.args[0], Node) else None
    return None


def _downstream(start: Node, through: set[str], stop: set[str]) -> Iterator[tuple[Node, Node]]:
    """``(node, the input it was reached from)`` for each node with an op in ``stop`` reached from ``start``
    through ops in ``through`` (a few steps: the ``+ eps`` and casts between the parts of a norm)."""
    frontier, seen = [start], {start}
    for _ in range(4):
        following = []
        for node in frontier:
            for user in node.users:
                if user in seen:
                    continue
                seen.add(user)
                if _op(user) in stop:
                    yield user, node
                elif _op(user) in through:
                    following.append(user)
        frontier = following


def _sources(node: Any) -> set[Any]:
    """``node`` and what it is elementwise made of (a few steps): a norm may scale ``x.float()``,
    ``x - x.mean(-1)`` or ``weight * x`` by the ``rsqrt``/``sqrt`` of ``x``'s moment."""
    found, frontier = {node}, [node]
    for _ in range(4):
        frontier = [arg for n in frontier if _op(n) in _ELEMENTWISE for arg in n.args if isinstance(arg, Node)]
        found.update(frontier)
    return found


def _scales(root: Node, base: Node, activations: set[Node]) -> bool:
    """Whether ``root`` (an ``rsqrt``/``sqrt``/``std`` of ``base``'s moment) multiplies or divides ``base``:
    both made of one activation (a shared weight does not count)."""
    made_of = _sources(base) & activations  # a centred base (x - u) is made of x, as x - u is
    for scale, reached_from in _downstream(root, _TO_SCALE, _SCALE):
        others = [arg for arg in scale.args if isinstance(arg, Node) and arg is not reached_from]
        if any(made_of & _sources(arg) for arg in others):
            return True
    return False


def norm_arithmetic(graph_module: torch.fx.GraphModule) -> list[Node]:
    """The ``rsqrt``/``sqrt``/``std`` node of each norm that ``graph_module`` computes as arithmetic on its
    inputs' data, in graph order (a weight's standardisation does not count: see ``norm_calls``)."""
    from_input: set[Node] = set()  # nodes computed from a placeholder (activations)
    roots: dict[Node, None] = {}
    for node in graph_module.graph.nodes:
        if node.op == "placeholder" or any(arg in from_input for arg in node.all_input_nodes):
            from_input.add(node)
        found = _moment(node)
        if found is None:
            continue
        base, rooted = found
        candidates = [node] if rooted else [root for root, _ in _downstream(node, _EPS, {"rsqrt", "sqrt"})]
        roots.update((root, None) for root in candidates if _scales(root, base, from_input))
    order = {node: i for i, node in enumerate(graph_module.graph.nodes)}
    return sorted(roots, key=order.__getitem__)
