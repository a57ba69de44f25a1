"""What ``torch.compile`` records: the call targets of the graphs AOTAutograd compiles."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def aot_graphs(fn: Callable, *args: Tensor) -> dict[str, list[str]]:
    """The call targets of the forward (``"fw"``) and backward (``"bw"``) graphs AOTAutograd hands
    to its compilers for a forward and a backward of ``fn(*args)`` (fullgraph: a break raises).
    The graphs run as recorded (no code generation), so their results are the ops' own."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, list[str]] = {}

    def capture(kind: str) -> Callable:
        def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            graphs[kind] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    out = torch.compile(fn, backend=aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw")),
                        fullgraph=True)(*args)
    out.sum().backward()
    return graphs
