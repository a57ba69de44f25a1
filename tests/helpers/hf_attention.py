"""Tiny transformers causal LMs for the QK-norm and attention-monitor tests.

The families are :data:`helpers.hf.FAMILIES` (the one coverage list), split into those with a
QK-norm of their own (:data:`NATIVE`) and the others (:data:`ADDS`). :func:`tiny_lm` builds one
in float64 or float32 from :func:`helpers.hf.tiny_config` made wider (4 query and 2 key/value
heads of 16); :class:`TinyLM` trains one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch.utils.data import TensorDataset

from helpers.hf import FAMILIES, tiny_config, transformers

__all__ = ["ADDS", "NATIVE", "QK_FAMILIES", "TinyLM", "tiny_lm", "token_data", "tokens"]

#: families with a QK-norm of their own: ``qk_norm`` swaps it
NATIVE = ("qwen3", "gemma3_text", "olmo2")
#: the other families of the coverage list: ``qk_norm`` adds one (by wrapping q/k projections)
ADDS = tuple(f for f in FAMILIES if f not in NATIVE)
QK_FAMILIES = FAMILIES

#: wider than tiny_config's default: 4 query and 2 key/value heads of 16 (GPT-2, GPT-NeoX: 4 heads)
_WIDER = dict(hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=96)
_NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}


def tiny_lm(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **config: Any) -> torch.nn.Module:
    """A 2-layer ``AutoModelForCausalLM`` of ``model_type`` (:func:`helpers.hf.tiny_config`, wider)
    with random weights, eager attention, in train mode."""
    cfg = tiny_config(model_type, **{**_WIDER, **_NO_DROPOUT.get(model_type, {}), **config})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)


def tokens(batch: int = 2, length: int = 7, vocab: int = 96, seed: int = 1) -> torch.Tensor:
    """``(batch, length)`` random token ids."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


class TinyLM(pl.LightningModule):
    """Next-token cross-entropy on :func:`tiny_lm` (built in ``__init__``), SGD, ``train/loss``."""

    def __init__(self, model_type: str = "llama", lr: float = 0.05, prepare: Optional[Callable] = None) -> None:
        super().__init__()
        self.lr = lr
        self.model = tiny_lm(model_type)
        if prepare is not None:
            prepare(self.model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits  # (B, N, vocab)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def token_data(n: int = 8, length: int = 7, seed: int = 1) -> TensorDataset:
    """``n`` random token sequences (a ``TensorDataset`` of one tensor)."""
    return TensorDataset(tokens(n, length, seed=seed))
