"""Tiny transformers causal LMs built from a config (nothing downloaded), for the QK-norm tests.

:data:`QK_FAMILIES` is the one list of the families the HF QK-norm tests cover;
:func:`tiny_lm` builds one in float64 or float32, eager attention, 2 layers, hidden 64, 4 query
heads and 2 key/value heads of 16 (GPT-2 and GPT-NeoX: 4 heads); :class:`TinyLM` trains one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import TensorDataset

transformers = pytest.importorskip("transformers")

__all__ = ["ADDS", "NATIVE", "QK_FAMILIES", "TinyLM", "tiny_lm", "token_data", "tokens"]

#: families whose attention has no QK-norm: ``qk_norm`` adds one (by wrapping q/k projections)
ADDS = ("llama", "mistral", "qwen2", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox")
#: families with a QK-norm of their own: ``qk_norm`` swaps it
NATIVE = ("qwen3", "gemma3_text", "olmo2")
QK_FAMILIES = ADDS + NATIVE

_IDS = dict(bos_token_id=0, eos_token_id=0, vocab_size=96)
_LAYERS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)
_CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": dict(_LAYERS),
    "gemma2": dict(_LAYERS, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
    "gemma3_text": dict(_LAYERS, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
    "phi3": dict(_LAYERS, num_key_value_heads=2, head_dim=16, pad_token_id=0),
}
_DEFAULT = dict(_LAYERS, num_key_value_heads=2, head_dim=16)  # the other families: GQA, 4 q / 2 kv heads


def tiny_lm(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **config: Any) -> torch.nn.Module:
    """A 2-layer ``AutoModelForCausalLM`` of ``model_type`` with random weights, eager attention."""
    kwargs = {**_IDS, **_CONFIGS.get(model_type, _DEFAULT), **config}
    cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.to(dtype)


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
