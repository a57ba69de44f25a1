"""The op under ``torch.compile`` (``lightning_mrs.ops.library``): one operator node per norm in the graphs,
no graph break, the compiled forward and backward equal to the eager op (and so to the float64
reference), the fake kernels true to the real ones (``torch.library.opcheck``), dynamic shapes,
and ``torch.export`` still recording the plain formula.

Inductor compiles take seconds each, so the default run compiles a few cases with Inductor and
checks the layout matrix through AOTAutograd's ``aot_eager`` backend (the same fake kernels and
autograd formula, no code generation).
"""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
from torch import Tensor, nn

from lightning_mrs import MRSNorm, MRSNorm2d, mrs_norm, swap_norms
from lightning_mrs.ops.dispatch import route_for
from helpers.checks import CPP_BUILT, LAYOUTS, TOLS, assert_matches_reference, grads, make_inputs, norm_model
from helpers.compiled import aot_graphs

OPS = torch.ops.lightning_mrs
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (layout name of helpers.checks.LAYOUTS, backend, the pair the router runs): every kind of call
OPCHECK_CASES = [("tokens", "auto", "op"), ("nchw_per_sample", "auto", "op"), ("nhwc_per_position", "auto", "op"),
                 ("nhwc_per_sample", "auto", "op"), ("tokens", "torch", "fallback"),
                 ("nchw_per_position", "auto", "fallback"), ("middle_dim", "auto", "fallback"),
                 ("tokens", "eager", "fallback")]


def _sliced(x: Tensor) -> Tensor:
    """``x`` as a view with a gap (every other row of a twice as large tensor)."""
    big = torch.zeros((2 * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    big[::2] = x
    return big[::2]


def _opcheck_pair(x: Tensor, w: Optional[Tensor], gy: Tensor, channel_dim: int, spatial: bool, backend: str,
                  pair: str) -> None:
    """``torch.library.opcheck`` (schema, fake kernel against the real one, AOTAutograd with dynamic
    shapes) on the forward and backward operators the router runs for this call. Inputs do not
    require grad: the operators have no autograd kernel of their own, the Function is their autograd."""
    route = route_for(x, w, 1e-6, channel_dim, spatial, backend)
    assert ("op" if route.fallback is None and route.kernel != "eager" else "fallback") == pair
    fwd, bwd = (OPS.mrs_norm_fwd, OPS.mrs_norm_bwd) if pair == "op" else \
        (OPS.mrs_norm_fwd_fallback, OPS.mrs_norm_bwd_fallback)
    extra = () if pair == "op" else (backend,)
    args = (x, w, 1e-6, channel_dim % x.ndim, spatial)
    torch.library.opcheck(fwd, (*args, *extra))
    _, r_sum = fwd(*args, *extra)
    torch.library.opcheck(bwd, (gy, *args[:2], r_sum, *args[2:], w is not None, *extra))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,backend,pair", OPCHECK_CASES, ids=[f"{l}-{b}" for l, b, _ in OPCHECK_CASES])
@pytest.mark.parametrize("affine", [True, False])
def test_opcheck_on_the_operators_the_graphs_run(layout: str, backend: str, pair: str, affine: bool,
                                                 device: str) -> None:
    shape, channel_dim, spatial, memory_format = LAYOUTS[layout]
    if device == "cuda":  # the Triton kernels run one S per position; the rest is the fallback pair's
        pair = "op" if not spatial and backend == "auto" else "fallback"
    x, w, gy = make_inputs(shape, channel_dim, memory_format, torch.float32, affine, device=device)
    _opcheck_pair(x, w, gy, channel_dim % x.ndim, spatial, backend, pair)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_on_an_input_with_gaps(device: str) -> None:
    x, w, gy = make_inputs((3, 7, 64), -1, None, torch.float32, device=device)
    _opcheck_pair(_sliced(x), w, gy, 2, False, "auto", "fallback" if device == "cpu" else "op")


def _captured(fn: Callable, *args: Tensor) -> list[torch.fx.GraphModule]:
    """The FX graphs Dynamo hands to its backend for ``fn(*args)`` (fullgraph: a break raises)."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs


def test_compiled_graphs_hold_one_op_node_per_norm_and_no_formula() -> None:
    model = norm_model()
    graphs = aot_graphs(model, torch.randn(2, 3, 6, 6, requires_grad=True))
    # the model's three MRSNorm layers: the forward op, and its backward op in the backward graph
    # (the per-sample NCHW and the token norm the C++ operators where they build, the per-position
    # NCHW norm the fallback pair)
    cpp = 2 if CPP_BUILT else 0
    assert graphs["fw"].count("lightning_mrs.mrs_norm_fwd.default") == cpp
    assert graphs["bw"].count("lightning_mrs.mrs_norm_bwd.default") == cpp
    assert graphs["fw"].count("lightning_mrs.mrs_norm_fwd_fallback.default") == 3 - cpp
    assert graphs["bw"].count("lightning_mrs.mrs_norm_bwd_fallback.default") == 3 - cpp
    assert not any("sqrt" in t for t in graphs["fw"] + graphs["bw"])  # the formula is not traced


def test_graph_break_count_is_zero_for_every_module() -> None:
    model = nn.Sequential(norm_model(), nn.Unflatten(1, (2, 8)), MRSNorm2d(2, spatial=True))
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 6, 6))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


# (name, shape, channel_dim, spatial, memory_format, input transform) compiled with Inductor
INDUCTOR_CASES = {
    "tokens_f32": ((5, 7, 64), -1, False, None, torch.float32),
    "nchw_per_sample_bf16": ((3, 64, 5, 7), 1, True, None, torch.bfloat16),
    "nchw_per_position_f32": ((3, 64, 5, 7), 1, False, None, torch.float32),
    "nhwc_per_sample_f16": ((3, 64, 5, 7), 1, True, torch.channels_last, torch.float16),
}


@pytest.mark.parametrize("case", list(INDUCTOR_CASES))
def test_inductor_compiled_op_equals_the_eager_op_forward_and_backward(case: str) -> None:
    shape, channel_dim, spatial, memory_format, dtype = INDUCTOR_CASES[case]
    x, w, gy = make_inputs(shape, channel_dim, memory_format, dtype)

    def norm(a: Tensor, b: Optional[Tensor]) -> Tensor:
        return mrs_norm(a, b, channel_dim=channel_dim, spatial=spatial)

    torch._dynamo.reset()
    compiled = torch.compile(norm, fullgraph=True, dynamic=False)
    got = grads(compiled, x, w, gy)
    eager = grads(norm, x, w, gy)
    for g, e in zip(got, eager):  # the same kernels at run time: equal to the last bit
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert got[0].stride() == x.stride()  # the memory format kept
    assert_matches_reference(got, x, w, gy, channel_dim, spatial)


# every layout in float32, one per kernel shape in bfloat16 (each case is a compile)
AOT_CASES = [(name, torch.float32) for name in LAYOUTS] + [
    (name, torch.bfloat16) for name in ("tokens", "nchw_per_sample", "nhwc_per_position")]


@pytest.mark.parametrize("layout,dtype", AOT_CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in AOT_CASES])
def test_aot_compiled_op_matches_the_reference_on_every_layout(layout: str, dtype: torch.dtype) -> None:
    shape, channel_dim, spatial, memory_format = LAYOUTS[layout]
    x, w, gy = make_inputs(shape, channel_dim, memory_format, dtype)

    def norm(a: Tensor, b: Optional[Tensor]) -> Tensor:
        return mrs_norm(a, b, channel_dim=channel_dim, spatial=spatial)

    torch._dynamo.reset()  # one code object for every case: Dynamo's limit of 8 variants per code object
    compiled = torch.compile(norm, backend="aot_eager", fullgraph=True, dynamic=False)
    got = grads(compiled, x, w, gy)
    assert_matches_reference(got, x, w, gy, channel_dim, spatial)
    sliced = _sliced(x)  # a view with gaps: the fake kernel's strides (empty_like) still hold
    got = grads(compiled, sliced, w, gy)
    assert_matches_reference(got, sliced, w, gy, channel_dim, spatial)


def test_dynamic_batch_sizes_reuse_one_graph_and_stay_exact() -> None:
    norm = MRSNorm(64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    torch._dynamo.reset()
    compiled = torch.compile(norm, fullgraph=True, dynamic=True)
    counts = []
    for batch in (3, 5, 11):
        x, _, gy = make_inputs((batch, 7, 64), -1, None, torch.float32, affine=False)
        got = grads(lambda a, b: compiled(a), x, None, gy)
        eager = grads(lambda a, b: norm(a), x, None, gy)
        torch.testing.assert_close(got[0], eager[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], eager[1], atol=0, rtol=0)
        counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert counts[0] == counts[-1]  # one graph for every batch size


def test_the_eager_backend_compiles_the_formula() -> None:
    norm = MRSNorm(16)
    norm.backend = "eager"
    (graph,) = _captured(norm, torch.randn(4, 16))
    targets = [str(n.target) for n in graph.graph.nodes if n.op in ("call_function", "call_method")]
    assert not any("lightning_mrs" in t for t in targets) and any("sqrt" in t for t in targets)


def test_torch_export_still_records_the_plain_formula() -> None:
    model = norm_model().eval()
    x = torch.randn(4, 3, 6, 6)
    exported = torch.export.export(model, (x,))
    assert not any("lightning_mrs" in str(n.target) for n in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(x), model(x), atol=1e-6, rtol=1e-6)


def _llama_step(model: nn.Module, tokens: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_llama_with_mrsnorm_equals_eager_without_a_graph_break() -> None:
    from helpers.hf import tiny_causal_lm, token_batch

    model = tiny_causal_lm("llama").train()
    swap_norms(model, target="mrs")
    assert sum(isinstance(m, MRSNorm) for m in model.modules()) == 5
    tokens = token_batch(4, 16)
    eager_loss, eager_grads = _llama_step(model, tokens)
    torch._dynamo.reset()
    forward = model.forward
    model.forward = torch.compile(forward, fullgraph=True, backend="aot_eager")  # a break raises
    try:
        loss, got = _llama_step(model, tokens)
    finally:
        model.forward = forward
    atol, rtol = TOLS[torch.float32]
    torch.testing.assert_close(loss, eager_loss, atol=atol, rtol=rtol)
    assert got.keys() == eager_grads.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, eager_grads[name], atol=10 * atol, rtol=10 * rtol, msg=name)


CUDA_CASES = {"tokens_bf16": ((5, 7, 64), -1, False, None, torch.bfloat16),  # the Triton kernels
              "nchw_per_sample_f32": ((3, 64, 5, 7), 1, True, None, torch.float32)}  # Inductor's


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_compiled_op_on_cuda_equals_the_eager_op(case: str) -> None:
    shape, channel_dim, spatial, memory_format, dtype = CUDA_CASES[case]
    x, w, gy = make_inputs(shape, channel_dim, memory_format, dtype, device="cuda")

    def norm(a: Tensor, b: Optional[Tensor]) -> Tensor:
        return mrs_norm(a, b, channel_dim=channel_dim, spatial=spatial)

    torch._dynamo.reset()
    got = grads(torch.compile(norm, fullgraph=True, dynamic=False), x, w, gy)
    for g, e in zip(got, grads(norm, x, w, gy)):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert_matches_reference(got, x, w, gy, channel_dim, spatial)
