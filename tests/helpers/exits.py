"""The swapped models the exit matrix (``tests/test_exit_matrix.py``) sends out and takes back.

:data:`CASES` names each (family, swap) the matrix walks: the four targets on Llama, Gemma's
``(1 + w)`` norms, Qwen3's own QK-norms swapped and QK-norms added to Llama. :class:`Built` is one
case built once, "trained" (no norm weight at its init, so a weight that does not load or a lost
``1 +`` changes the logits), its logits and its ``save_pretrained`` directory. :data:`LOADERS`,
:data:`COPIES` and :data:`GRAPHS` are the exits (each gives back logits or a model), :func:`named_tests` the
test references of docs/exits.md.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from helpers.hf import tiny_causal_lm, token_batch, transformers
from lightning_mrs import MRSNorm, MRSNorm2d, from_pretrained, swap_norms

__all__ = ["CASES", "COPIES", "GRAPHS", "LOADERS", "PLAIN_FORMULA", "REFUSED", "Built", "HandRMSNorm",
           "Logits", "build", "close", "equal_or_refused", "fresh", "logits_of", "named_tests", "small_net", "swap",
           "trained"]

#: case id -> (family, swap options)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-mrs": ("llama", dict(target="mrs")),
    "llama-rms-half": ("llama", dict(target="rms-half")),
    "llama-layer": ("llama", dict(target="layer")),
    "llama-dyt": ("llama", dict(target="dyt")),
    "llama-rms": ("llama", dict(target="rms")),  # the family's own maths, bit for bit in float32
    "gemma-mrs": ("gemma", dict(target="mrs")),
    "gemma-rms-half": ("gemma", dict(target="rms-half")),  # GemmaRMSNorm computes rms(x) * (1 + w)
    "gemma-rms": ("gemma", dict(target="rms")),  # OffsetRMSNorm: Gemma's own maths and weights
    "qwen3-mrs": ("qwen3", dict(target="mrs", qk_norm="mrs")),  # its own QK-norms swapped too
    "llama-qk": ("llama", dict(target=None, qk_norm="mrs")),  # QK-norms added by hooks
}

#: a refusal whose exact wording is being written elsewhere (issue 61 cases 1, 3, 7): it names us
#: or the swap
REFUSED = r"lightning_mrs|lightning-mrs|swapped|swap_norms|refus"


def swap(model: nn.Module, case: str) -> nn.Module:
    """``model`` swapped as ``case`` says (quietly: a note about QK hooks is not a row's business)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swap_norms(model, **CASES[case][1])
    return model


def trained(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every 1-d parameter moved off where the swap put it (a "trained" model)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@dataclass
class Built:
    """One case: the swapped model, its logits on :func:`token_batch` and its saved directory."""

    case: str
    model: nn.Module
    logits: torch.Tensor
    path: Path

    @property
    def family(self) -> str:
        return CASES[self.case][0]

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model.model(ids).last_hidden_state


def build(case: str, root: Path) -> Built:
    """Build, swap, "train" and ``save_pretrained`` one case under ``root``."""
    model = trained(swap(tiny_causal_lm(CASES[case][0]), case))
    with torch.no_grad():
        logits = model(token_batch()).logits
    path = root / case
    model.save_pretrained(path)
    return Built(case, model, logits, path)


def fresh(case: str, seed: int = 1) -> nn.Module:
    """Another model of the case's family and swap (other weights): where a state dict goes."""
    return swap(tiny_causal_lm(CASES[case][0], seed=seed), case)


def logits_of(model: nn.Module, ids: torch.Tensor | None = None) -> torch.Tensor:
    """A loaded model's logits with the eager attention the saved model ran."""
    config = getattr(model, "config", None)
    if config is not None:
        config._attn_implementation = "eager"
    with torch.no_grad():
        return model(token_batch() if ids is None else ids).logits


class Logits(nn.Module):
    """A causal LM as ``ids -> logits`` (one tensor out, no KV cache): what export and tracing take."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


class HandRMSNorm(nn.Module):
    """transformers' hand-written RMSNorm (LlamaRMSNorm's maths): what ``symbolic_trace`` inlines."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(channels))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def small_net(hand_written: bool = True) -> nn.Module:
    """Linear, a hand-written RMSNorm (if asked), nn.LayerNorm and nn.RMSNorm on 8 channels, eval mode."""
    norms = [HandRMSNorm(8)] if hand_written else []
    return trained(nn.Sequential(nn.Linear(8, 8), *norms, nn.LayerNorm(8), nn.GELU(), nn.RMSNorm(8))).eval()


def equal_or_refused(run: Callable[[], Any], expected: torch.Tensor, then: Callable[[Any], torch.Tensor] | None = None,
                     error: type = Exception) -> None:
    """The row's contract where the issue allows both: ``run()`` raises ``error`` in one line naming
    lightning-mrs or the swap, or what it gives (``then(result)``: logits) is ``expected`` bit for bit.
    Only ``run`` may refuse: the checks on what it gave are outside the ``try``."""
    try:
        result = run()
    except error as exc:
        message = str(exc)
        assert not isinstance(exc, AssertionError), message
        assert "\n" not in message.strip() and re.search(REFUSED, message), message
        return
    got = result if then is None else then(result)
    assert torch.equal(got, expected), (got - expected).abs().max().item()


# ---- the exits: each gives back what the row compares ------------------------------------------------------


def _auto_trust(b: Built) -> torch.Tensor:
    return logits_of(transformers.AutoModelForCausalLM.from_pretrained(b.path, trust_remote_code=True))


def _lightning_mrs(b: Built) -> torch.Tensor:
    return logits_of(from_pretrained(b.path, attn_implementation="eager"))


def _device_map_cpu(b: Built) -> torch.Tensor:
    return logits_of(transformers.AutoModelForCausalLM.from_pretrained(b.path, trust_remote_code=True, device_map="cpu"))


def _init_empty_weights(b: Built) -> torch.Tensor:
    """accelerate's big-model load: the swapped class built on the meta device, then the weights dispatched."""
    accelerate = pytest.importorskip("accelerate")
    config = transformers.AutoConfig.from_pretrained(b.path, trust_remote_code=True)
    with accelerate.init_empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    assert {p.device.type for p in empty.parameters()} == {"meta"}
    empty.tie_weights()  # as accelerate's docs say (Gemma ties its head to its embedding)
    return logits_of(accelerate.load_checkpoint_and_dispatch(empty, str(b.path), device_map={"": "cpu"}))


LOADERS = {"auto_trust": _auto_trust, "lightning_mrs": _lightning_mrs, "device_map_cpu": _device_map_cpu,
           "init_empty_weights": _init_empty_weights}


def _state_dict(b: Built, tmp_path: Path) -> torch.nn.Module:
    again = fresh(b.case)
    again.load_state_dict(b.model.state_dict())  # strict
    return again


def _pickle_then_save_pretrained(b: Built, tmp_path: Path) -> torch.nn.Module:
    pickle.loads(pickle.dumps(b.model)).save_pretrained(tmp_path)  # the record is read off the unpickled modules
    return from_pretrained(tmp_path, attn_implementation="eager")


def _torch_save(b: Built, tmp_path: Path) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(b.model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"state_dict": _state_dict, "deepcopy": lambda b, _: copy.deepcopy(b.model),
          "pickle": lambda b, _: pickle.loads(pickle.dumps(b.model)), "torch_save": _torch_save,
          "pickle_then_save_pretrained": _pickle_then_save_pretrained}

#: mrs under export/tracing runs the plain formula the op records, not its kernels: allclose (measured <= 2e-7)
PLAIN_FORMULA = dict(atol=1e-6, rtol=1e-6)


def close(got: torch.Tensor, b: Built) -> None:
    """Equal to the saved logits; allclose where an MRSNorm runs the plain formula (export, tracing)."""
    if any(isinstance(m, (MRSNorm, MRSNorm2d)) for m in b.model.modules()):
        torch.testing.assert_close(got, b.logits, **PLAIN_FORMULA)
    else:
        assert torch.equal(got, b.logits)


def _export(b: Built, tmp_path: Path) -> torch.Tensor:
    program = torch.export.export(Logits(b.model), (token_batch(),))
    torch.export.save(program, tmp_path / "program.pt2")
    loaded = torch.export.load(tmp_path / "program.pt2")  # the program, saved and loaded
    module = program.module()
    assert torch.equal(loaded.module()(token_batch()), module(token_batch()))
    return module(token_batch())


def _jit_trace(b: Built, tmp_path: Path) -> torch.Tensor:
    traced = torch.jit.trace(Logits(b.model), (token_batch(),), strict=False)
    torch.jit.save(traced, tmp_path / "traced.pt")
    return torch.jit.load(tmp_path / "traced.pt")(token_batch())


def _compile(b: Built, tmp_path: Path) -> torch.Tensor:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # a recompile limit left by another test would run it eagerly
    counter = CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        out = torch.compile(Logits(b.model), backend=counter)(token_batch())
    assert counter.frame_count >= 1
    return out


def _onnx(b: Built, tmp_path: Path) -> torch.Tensor:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    program = torch.onnx.export(Logits(b.model), (token_batch(),), dynamo=True, verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    out = session.run(None, {session.get_inputs()[0].name: token_batch().numpy()})[0]
    return torch.from_numpy(out)


GRAPHS = {"export": _export, "jit_trace": _jit_trace, "compile": _compile, "onnx": _onnx}

def named_tests(root: Path) -> tuple[set[str], set[str]]:
    """The page's test references: full node ids (``[x]`` after one inherits its function; ``*`` a wildcard),
    and bare files."""
    nodes, files = set(), set()
    for line in (root / "docs" / "exits.md").read_text().splitlines():
        last = None
        for token in re.findall(r"`([^`]+)`", line):
            if re.fullmatch(r"tests/[\w/]+\.py", token):
                files.add(token)
            elif re.fullmatch(r"tests/[\w/]+\.py::\w+(\[[^\]\s]+\])?", token):
                nodes.add(token)
                last = token.split("[")[0]
            elif last and re.fullmatch(r"\[[^\]\s]+\]", token):
                nodes.add(last + token)
    return nodes, files


