"""A swap after a graph exit sees every norm or refuses in one line, the model untouched (issue 61 case 3).

Before: ``symbolic_trace`` of a model with a hand-written RMSNorm (transformers' ``LlamaRMSNorm``) left
``pow``/``mean``/``rsqrt`` nodes that a swap skipped ("1 converted, 0 skipped": only the ``nn.LayerNorm``
beside it); ``torch.export``'s module and ``torch.jit.trace``'s were swapped to nothing ("0 converted");
``torch.jit.script``'s crashed in the probe; an ``ExportedProgram`` was told to "build the model first".
A ``torch.compile`` module is swapped through its ``_orig_mod``, and dynamo recompiles: equal to the eager swap.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn

from lightning_mrs import swap_norms
from lightning_mrs.swap.fx_arithmetic import norm_arithmetic


class HandRMS(nn.Module):
    """The issue's repro: the arithmetic of ``LlamaRMSNorm`` (cast to float32, rsqrt, weight)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Hand(nn.Module):
    """Other hand-written norms, as tracing leaves them: each computes one norm over the last dim."""

    def __init__(self, form: str, width: int = 8) -> None:
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        if self.form == "gemma":  # (1 + w), x * x
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight)
        if self.form == "square-sqrt":  # divide by sqrt of torch.square's mean
            return self.weight * x / torch.sqrt(torch.mean(torch.square(x), dim=-1, keepdim=True) + 1e-6)
        if self.form == "centred":  # LayerNorm: mean of the centred square
            u = x.mean(-1, keepdim=True)
            s = (x - u).pow(2).mean(-1, keepdim=True)
            return self.weight * ((x - u) / torch.sqrt(s + 1e-5))
        if self.form == "var":  # LayerNorm through var, clamped
            return (x - x.mean(-1, keepdim=True)) * (x.var(-1, keepdim=True, unbiased=False).clamp_min(1e-5)).rsqrt()
        if self.form == "var_mean":
            var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
            return self.weight * (x - mean) / (var + 1e-5).sqrt()
        # "std": the Annotated Transformer's LayerNorm
        return self.weight * (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6)


def _repro() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), HandRMS(8), nn.LayerNorm(8)).eval()


def _untouched(model: nn.Module, x: Tensor):
    """A check that ``model``'s state and output are what they are now."""
    state, before = copy.deepcopy(model.state_dict()), model(x)
    kinds = [type(m) for m in model.modules()]

    def check() -> None:
        assert [type(m) for m in model.modules()] == kinds and model.state_dict().keys() == state.keys()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
        assert torch.equal(model(x), before)
    return check


def test_the_issues_traced_hand_written_rmsnorm_is_refused_and_left_untouched() -> None:
    gm = torch.fx.symbolic_trace(_repro())
    x = torch.randn(2, 3, 8)
    check = _untouched(gm, x)
    code = gm.code
    with pytest.raises(ValueError) as err:
        swap_norms(gm, "mrs")
    assert str(err.value) == (
        "swap_norms: the model is a torch.fx GraphModule that computes 1 norms as arithmetic, not layers (1 mean of "
        "squares or variance, then rsqrt/sqrt, at node rsqrt), which no swap can replace; nothing was changed: swap "
        "the eager model first, then trace it (symbolic_trace, create_feature_extractor; for timm's "
        "features_only=True, feature_cls='fx': timm.models.FeatureGraphNet(swapped, out_indices))")
    with pytest.raises(ValueError, match="computes 1 norms as arithmetic"):
        swap_norms(gm, "rms", strict=False)
    check()
    assert gm.code == code
    # the fix the message gives: swap the eager model, then trace it; exactly the swapped eager model
    eager = _repro()
    report = swap_norms(eager, "mrs")
    assert sorted(report.converted) == ["1", "2"]
    assert torch.equal(torch.fx.symbolic_trace(eager)(x), eager(x))


@pytest.mark.parametrize("form", ["gemma", "square-sqrt", "centred", "var", "var_mean", "std"])
def test_every_hand_written_norm_in_a_traced_graph_is_refused(form: str) -> None:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), Hand(form), nn.ReLU()))
    assert len(norm_arithmetic(gm)) == 1
    check = _untouched(gm, torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"^swap_norms: the model is a torch.fx GraphModule that computes 1 norms as "
                                         r"arithmetic, not layers \(1 mean of squares or variance, then rsqrt/sqrt, "
                                         r"at node \w+\), which no swap can replace"):
        swap_norms(gm, "layer")
    check()
    swap_norms(gm, None)  # no target: the graph's norms are kept, nothing to refuse


def test_transformers_own_rmsnorms_traced_are_refused() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), llama.LlamaRMSNorm(8), nn.GELU(), gemma.GemmaRMSNorm(8),
                          nn.LayerNorm(8)).eval()
    gm = torch.fx.symbolic_trace(model)
    check = _untouched(gm, torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"computes 2 norms as arithmetic, not layers \(2 mean of squares or variance, "
                                         r"then rsqrt/sqrt, at nodes rsqrt, rsqrt_1\)"):
        swap_norms(gm, "mrs")
    check()


class Both(nn.Module):
    """A norm as a function call and a hand-written one: the refusal counts and names both."""

    def __init__(self) -> None:
        super().__init__()
        self.hand = Hand("gemma")

    def forward(self, x: Tensor) -> Tensor:
        return self.hand(torch.nn.functional.layer_norm(x, [8]))


def test_a_graph_with_norm_calls_and_arithmetic_names_both() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), Both()))
    with pytest.raises(ValueError, match=r"computes 2 norms as function calls and arithmetic, not layers "
                                         r"\(1 layer_norm, 1 mean of squares or variance, then rsqrt/sqrt, "
                                         r"at node rsqrt\)"):
        swap_norms(gm, "mrs")


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).eval(), torch.randint(0, 64, (1, 6))


def test_an_exported_llama_is_refused_as_a_module_and_as_a_program() -> None:
    llama, ids = _llama()
    program = torch.export.export(llama, (ids,), {"use_cache": False})
    module = program.module()
    before = module(ids, use_cache=False).logits
    assert norm_arithmetic(module)  # its 3 LlamaRMSNorms are aten pow/mean/rsqrt now (refused whatever they are)
    message = (r"^swap_norms: the model is a torch.export module \(\w+\), whose layers export flattened into aten ops, "
               r"so no swap can replace its norms or attention; nothing was changed: swap the eager model first, "
               r"then export it \(torch.export.export\(swapped, args\).module\(\)\)$")
    for target in ("mrs", "layer"):
        with pytest.raises(ValueError, match=message):
            swap_norms(module, target, strict=False)
    with pytest.raises(ValueError, match=message):  # QK-norms only: its attention is aten ops too
        swap_norms(module, None, qk_norm="mrs")
    unflattened = torch.export.unflatten(program)  # a tree of InterpreterModules, no norm layer either
    with pytest.raises(ValueError, match=r"^swap_norms: the model is a torch.export module \(UnflattenedModule\)"):
        swap_norms(unflattened, "mrs")
    assert torch.equal(module(ids, use_cache=False).logits, before)
    with pytest.raises(TypeError, match=r"^swap_norms: model must be a torch.nn.Module, got a torch.export "
                                        r"ExportedProgram, whose layers export flattened into aten ops, so no swap "
                                        r"can replace its norms; pass the eager model \(swap it first, then export"):
        swap_norms(program, "mrs")
    # the fix: swap, then export; the exported graph computes the swapped model (not the plain one)
    plain = llama(ids, use_cache=False).logits
    swap_norms(llama, "mrs")
    swapped = llama(ids, use_cache=False).logits
    exported = torch.export.export(llama, (ids,), {"use_cache": False}).module()(ids, use_cache=False).logits
    # export traces the reference formula, not the eager kernels: equal up to float rounding
    torch.testing.assert_close(exported, swapped, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(exported, plain, atol=1e-3)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_module_is_refused(how: str) -> None:
    model, x = _repro(), torch.randn(2, 3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript is deprecated
        compiled = torch.jit.script(model) if how == "script" else torch.jit.trace(model, (x,))
    check = _untouched(compiled, x)
    with pytest.raises(ValueError, match=r"^swap_norms: the model is a TorchScript module \(Sequential\) whose "
                                         r"compiled code computes norms \(layer_norm, rsqrt\), which no swap "
                                         r"can replace; nothing was changed: swap the eager model first, then script "
                                         r"or trace it"):
        swap_norms(compiled, "mrs")
    check()


def test_a_scripted_part_is_refused_only_if_it_computes_a_norm() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = nn.Sequential(nn.Linear(8, 8), torch.jit.script(nn.ReLU()), nn.LayerNorm(8))
        hidden = nn.Sequential(nn.Linear(8, 8), torch.jit.script(nn.Sequential(nn.ReLU(), nn.LayerNorm(8))))
    twin = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.LayerNorm(8))
    twin.load_state_dict(model.state_dict())
    report = swap_norms(model, "mrs")  # a scripted ReLU: nothing of a norm inside, the LayerNorm beside it swapped
    assert report.converted == ["2"] and sorted(swap_norms(twin, "mrs").converted) == ["2"]
    x = torch.randn(4, 8)
    assert torch.equal(model(x), twin(x))
    with pytest.raises(ValueError, match=r"^swap_norms: 1 is a TorchScript module \(Sequential\) whose compiled code "
                                         r"computes norms \(layer_norm\)"):
        swap_norms(hidden, "mrs")


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_compiled_module_is_swapped_and_recompiled(how: str) -> None:
    x = torch.randn(2, 3, 8)
    eager = _repro()
    swap_norms(eager, "mrs")
    expected = eager(x)
    model = _repro()
    if how == "torch.compile":
        compiled = torch.compile(model, backend="eager")
    else:
        compiled = model
        compiled.compile(backend="eager")
    plain = compiled(x)  # compiled with the old norms
    report = swap_norms(compiled, "mrs")
    prefix = "_orig_mod." if how == "torch.compile" else ""
    assert sorted(report.converted) == [prefix + "1", prefix + "2"]
    out = compiled(x)
    assert torch.equal(out, expected) and not torch.equal(out, plain)


# ---- graphs that stay allowed: norms that are layers, and a mean of squares that normalises nothing ----

class Heads(nn.Module):
    """A LayerNorm layer among arithmetic that is not a norm: attention's softmax and scale, a loss and a
    relative loss (scaled by the target's RMS), an RMS metric, an L2 normalisation (``F.normalize``, a sum
    of squares) and a weight's standardisation."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: Tensor, target: Tensor) -> tuple[Tensor, ...]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = (q @ k.transpose(-2, -1) * q.size(-1) ** -0.5).softmax(-1)
        y = self.norm(attn @ v)
        loss = ((y - target) ** 2).mean()
        relative = loss * torch.rsqrt(target.pow(2).mean(-1, keepdim=True) + 1e-8)  # scales the loss, not target
        rms = torch.sqrt(y.pow(2).mean(-1, keepdim=True))  # a metric, scaling nothing
        unit = torch.nn.functional.normalize(y, dim=-1) + y / y.pow(2).sum(-1, keepdim=True).sqrt()
        w = self.proj
        standard = (w - w.mean(-1, keepdim=True)) * torch.rsqrt(w.pow(2).mean(-1, keepdim=True) + 1e-5)
        return y @ standard, loss, relative, rms, unit


def test_arithmetic_that_is_not_a_norm_is_not_refused() -> None:
    torch.manual_seed(0)
    eager = Heads()
    gm = torch.fx.symbolic_trace(copy.deepcopy(eager))
    assert norm_arithmetic(gm) == []
    assert swap_norms(gm, "mrs").converted == ["norm"] and swap_norms(eager, "mrs").converted == ["norm"]
    x, target = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    for a, b in zip(gm(x, target), eager(x, target)):
        assert torch.equal(a, b)


def test_a_swapped_then_traced_model_holds_no_arithmetic_norm() -> None:
    # each swapped norm is one fx-wrapped node, never pow/mean/rsqrt: the arithmetic check cannot misfire on it
    # (a second swap of such a graph is refused as before for its norm calls: tests/swap/test_fx_norm_calls.py)
    eager = _repro()
    swap_norms(eager, "rms")
    gm = torch.fx.symbolic_trace(eager)
    assert norm_arithmetic(gm) == [] and swap_norms(gm, None).converted == []
    x = torch.randn(2, 3, 8)
    assert torch.equal(gm(x), eager(x))


def test_feature_extractors_of_swapped_and_of_plain_models_stay_allowed() -> None:
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.feature_extraction import create_feature_extractor
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(32, 8, 2, 2, 16, 32).eval()
    swapped = copy.deepcopy(vit)
    swap_norms(swapped, "mrs")
    nodes = {"encoder.layers.encoder_layer_1": "block"}
    x = torch.randn(2, 3, 32, 32)
    extracted = create_feature_extractor(swapped, nodes)  # swapped, then traced
    assert norm_arithmetic(extracted) == []
    expected = extracted(x)["block"]
    plain = create_feature_extractor(vit, nodes)  # traced (LayerNorms stay leaf layers), then swapped
    assert norm_arithmetic(plain) == []
    assert len(swap_norms(plain, "mrs").converted) == 4
    assert torch.equal(plain(x)["block"], expected)
