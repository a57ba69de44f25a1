"""ONNX export of swapped models (issue 45 §5): ``torch.onnx.export(..., dynamo=True)`` run by
onnxruntime against the eager swapped model, with the unswapped model exported the same way as
the control.

A swapped model exports through ``torch.export``, where the op records the plain reference
formula (``lightning_mrs/ops/mrs_norm.py``): the ONNX graph holds only standard ONNX operators
(``Sqrt``, ``ReduceMean``, ``Div``, ``Mul``...), no custom domain, so any ONNX runtime runs it.
Each swapped case also checks that the runtime's output is the *swapped* model's, not the
unswapped one's (a graph that silently lost the swap would match the control instead).

Tolerances (onnxruntime CPU against eager torch CPU): float32 ``atol=1e-5, rtol=1e-4`` (measured
at most 6e-7 on these models), float16 ``atol=5e-3, rtol=1e-2`` on logits of size ~1 (measured 9e-4, as
far as eager float16 itself is from float64: the runtimes round the float16 convolutions differently).
"""

from __future__ import annotations

import copy
import io
import warnings
from typing import Optional

import pytest
import torch
from torch import nn

import lightning_mrs as lm

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")
pytest.importorskip("onnx", reason="ONNX export tests need the onnx extra: pip install lightning-mrs[onnx]")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript (the onnx extra)")
ort = pytest.importorskip("onnxruntime", reason="checking an ONNX export needs onnxruntime (the onnx extra)")

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=1e-2)}


def _cnn() -> tuple[nn.Module, torch.Tensor]:
    model = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)
    return model.eval(), torch.randn(2, 3, 32, 32)


def _vit() -> tuple[nn.Module, torch.Tensor]:
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              qk_norm=True, num_classes=10)
    return model.eval(), torch.randn(2, 3, 32, 32)


def _llama() -> tuple[nn.Module, torch.Tensor]:
    from helpers.exits import Logits
    from helpers.hf import tiny_causal_lm, token_batch

    return Logits(tiny_causal_lm("llama", use_cache=False)).eval(), token_batch(2, 8)


MODELS = {"cnn": _cnn, "vit": _vit, "llama": _llama}


def _swap(model: nn.Module, name: str) -> lm.SwapReport:
    """Swap as the docs show (Llama: body and per-head QK-norms), then move every MRS weight off
    its init so that a graph that dropped or misplaced a weight would show."""
    report = lm.swap_norms(model, "mrs", qk_norm="mrs") if name == "llama" else lm.swap_norms(model, "mrs")
    assert report.converted and not report.skipped, str(report)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (lm.MRSNorm, lm.MRSNorm2d)) and module.weight is not None:
                module.weight.add_(0.3 * torch.randn_like(module.weight))
    return report


def export_and_run(model: nn.Module, example: torch.Tensor, inputs: list[torch.Tensor],
                   dynamic_shapes: Optional[tuple] = None) -> list[torch.Tensor]:
    """Export ``model`` with ``torch.onnx.export(dynamo=True)`` on ``example`` and run the ONNX
    model in onnxruntime on each of ``inputs``; checks the graph uses the standard ONNX domain only."""
    program = torch.onnx.export(model, (example,), dynamo=True, verbose=False, dynamic_shapes=dynamic_shapes)
    proto = program.model_proto
    domains = {node.domain for node in proto.graph.node} - {"", "ai.onnx"}
    assert not domains, f"the exported graph needs custom operator domains {domains}"
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return [torch.from_numpy(session.run(None, {name: x.numpy()})[0]) for x in inputs]


@pytest.mark.parametrize(
    "name,swapped",
    [("cnn", True), ("cnn", False), ("vit", True), ("llama", True),
     pytest.param("vit", False, marks=pytest.mark.slow), pytest.param("llama", False, marks=pytest.mark.slow)],
)
def test_onnx_export_matches_eager(name: str, swapped: bool) -> None:
    model, x = MODELS[name]()
    unswapped = copy.deepcopy(model)
    if swapped:
        _swap(model, name)
    (out,) = export_and_run(model, x, [x])
    with torch.no_grad():
        expected, control = model(x), unswapped(x)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    if swapped:  # the graph computes the swapped model, not the unswapped one
        assert (out - control).abs().max() > 1e-2


@pytest.mark.slow
def test_onnx_export_dynamic_batch_and_float16() -> None:
    """A dynamic batch dim (one export, other batch sizes at run time) and a float16 export of the
    swapped CNN (the formula runs in float32 inside the graph, as eagerly)."""
    model, x = _cnn()
    _swap(model, "cnn")
    batch = torch.export.Dim("batch", min=1, max=64)
    inputs = [torch.randn(b, 3, 32, 32) for b in (1, 5)]
    for inp, out in zip(inputs, export_and_run(model, x, inputs, dynamic_shapes=({0: batch},))):
        with torch.no_grad():
            torch.testing.assert_close(out, model(inp), **TOL[torch.float32])
    half = model.half()
    (out,) = export_and_run(half, x.half(), [x.half()])
    with torch.no_grad():
        torch.testing.assert_close(out, half(x.half()), **TOL[torch.float16])


@pytest.mark.slow
def test_onnx_export_llama_dynamic_batch_and_length() -> None:
    """One export of the swapped Llama serves other batch sizes and sequence lengths."""
    model, ids = _llama()
    _swap(model, "llama")
    dims = {0: torch.export.Dim("batch", min=1, max=8), 1: torch.export.Dim("seq", min=2, max=32)}
    inputs = [ids, torch.randint(3, 64, (3, 13))]
    for inp, out in zip(inputs, export_and_run(model, ids, inputs, dynamic_shapes=(dims,))):
        with torch.no_grad():
            torch.testing.assert_close(out, model(inp), **TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("target,options", [("rms", {}), ("layer", {}), ("mrs", dict(spatial=False))])
def test_onnx_export_baselines_and_per_position(target: str, options: dict) -> None:
    """The baselines' 2-d layers (RMSNorm2d, LayerNorm2d) and MRSNorm2d with one S per position."""
    model, x = _cnn()
    report = lm.swap_norms(model, target, **options)
    assert report.converted and not report.skipped
    (out,) = export_and_run(model, x, [x])
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **TOL[torch.float32])


def test_onnx_legacy_exporter() -> None:
    """The TorchScript-based exporter (``dynamo=False``, deprecated by torch) traces the plain
    formula too (``torch.jit`` tracing takes the reference path of the op)."""
    model, x = _cnn()
    _swap(model, "cnn")
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the modules' shape checks warn while traced (harmless), and
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # torch warns that this exporter is legacy
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (x,), buffer, dynamo=False)
    session = ort.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    out = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **TOL[torch.float32])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_onnx_export_hf_families_sdpa(family: str) -> None:
    """transformers' default attention (sdpa) and the families with QK-norms of their own (Qwen3,
    Gemma 3: swapped, not added; Gemma's ``1 + w`` norms) export too."""
    import transformers
    from helpers.exits import Logits
    from helpers.hf import tiny_config, token_batch

    model = Logits(transformers.AutoModelForCausalLM.from_config(tiny_config(family, use_cache=False))).eval()
    assert model.lm.config._attn_implementation == "sdpa"
    report = lm.swap_norms(model, "mrs", qk_norm="mrs")
    assert report.converted and not report.skipped
    ids = token_batch()
    (out,) = export_and_run(model, ids, [ids])
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids), **TOL[torch.float32])
