"""The swapped models the exit matrix (``tests/test_exit_matrix.py``) sends out and takes back.

:data:`CASES` names each (family, swap) the matrix walks: the four targets on Llama, Gemma's
``(1 + w)`` norms, Qwen3's own QK-norms swapped and QK-norms added to Llama. :class:`Built` is one
case built once, "trained" (no norm weight at its init, so a weight that does not load or a lost
``1 +`` changes the logits), its logits and its ``save_pretrained`` directory.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from helpers.hf import tiny_causal_lm, token_batch
from lightning_mrs import swap_norms

__all__ = ["CASES", "REFUSED", "Built", "HandRMSNorm", "Logits", "build", "equal_or_refused", "fresh", "logits_of",
           "small_net", "swap", "trained"]

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


def equal_or_refused(run: Callable[[], torch.Tensor], expected: torch.Tensor, error: type = Exception) -> None:
    """The row's contract where the issue allows both: ``run()`` gives ``expected`` bit for bit, or
    raises ``error`` in one line naming lightning-mrs or the swap."""
    try:
        got = run()
    except error as exc:
        message = str(exc)
        assert "\n" not in message.strip() and re.search(REFUSED, message), message
        return
    assert torch.equal(got, expected), (got - expected).abs().max().item()
