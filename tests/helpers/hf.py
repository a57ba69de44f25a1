"""Tiny Hugging Face causal LMs built from configs (nothing downloaded): the one list of the
families the project covers, and their tiny configs.

``tiny_causal_lm("llama")`` is a 2-layer Llama of width 32 (4 heads of 8, 2 KV heads), vocab 64,
in float32 and eval mode, seeded. :data:`FAMILIES` is the coverage list of issue 18;
:func:`tiny_config` builds a config for any other ``model_type`` too (the slow sweep).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

__all__ = ["FAMILIES", "LAYERNORM_FAMILIES", "NORMS", "VOCAB", "lit_causal_lm", "tiny_causal_lm", "tiny_config", "token_batch",
           "token_data"]

VOCAB = 64
#: the families every norm-swap test covers (issue 18 §2) -> what their norms compute, read off
#: their source in transformers 5.24 (the probe must find it; ``torch`` = nn.LayerNorm, no probe)
NORMS = {
    "llama": "rms(x) * w", "mistral": "rms(x) * w", "qwen2": "rms(x) * w", "qwen3": "rms(x) * w",
    "gemma": "rms(x) * (1 + w)", "gemma2": "rms(x) * (1 + w)", "gemma3_text": "rms(x) * (1 + w)",
    "olmo2": "rms(x) * w", "phi3": "rms(x) * w", "gpt2": "torch", "gpt_neox": "torch",
}
FAMILIES = tuple(NORMS)
#: LayerNorm-style transformers classes outside the list, probed too (OLMo 1, Cohere, Nemotron)
LAYERNORM_FAMILIES = {"olmo": "layer(x)", "cohere": "layer(x) * w", "nemotron": "layer(x) * (1 + w) + b"}

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,  # the defaults (32000...) lie outside a vocab of 64
)
#: per family: config names that differ from the Llama-style ones above
_FAMILY: dict[str, dict[str, Any]] = {
    "gpt2": dict(n_positions=64, n_inner=64),  # hidden_size, num_attention_heads... map to n_embd, n_head...
    "gpt_neox": dict(rotary_pct=1.0),
    "gemma2": dict(sliding_window=16),
    "gemma3_text": dict(sliding_window=16),
}


#: mixture-of-experts sizes, set only where the family's config has them (4 experts of width 32)
_MOE: dict[str, Any] = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1)


def tiny_config(model_type: str, **overrides: Any) -> "transformers.PretrainedConfig":
    """A 2-layer config of width 32 and vocab 64 for ``model_type`` (``overrides`` win); a
    mixture of experts gets 4 experts of width 32."""
    defaults = transformers.CONFIG_MAPPING[model_type]()
    moe = {k: v for k, v in _MOE.items() if isinstance(getattr(defaults, k, None), int)}
    return transformers.AutoConfig.for_model(
        model_type, **{**_COMMON, **moe, **_FAMILY.get(model_type, {}), **overrides})


def tiny_causal_lm(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A freshly built causal LM of :func:`tiny_config` (float32, eval mode, eager attention).

    Every 1-d parameter (norm weights and biases) is moved off its init (``+ 0.1 * randn``), so a
    swap that mishandles a weight, a bias or an offset (Gemma's ``1 + w``) changes the logits.
    """
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = "eager"  # the same maths on every machine
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def token_batch(batch: int = 2, length: int = 8, seed: int = 0) -> torch.Tensor:
    """Random token ids ``(batch, length)`` in the tiny vocab."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def token_data(n: int = 16, length: int = 8, seed: int = 1) -> "torch.utils.data.TensorDataset":
    """``n`` random token sequences ``(n, length)``: the inputs and the next-token labels."""
    return torch.utils.data.TensorDataset(token_batch(n, length, seed))


def lit_causal_lm(model_type: str, lr: float = 0.05, **overrides: Any) -> "pl.LightningModule":
    """A LightningModule around :func:`tiny_causal_lm`: next-token loss with SGD; ``forward``
    gives the logits ``(B, N, vocab)``. Built from the config each time (a "fresh model")."""
    import lightning.pytorch as pl

    class LitCausalLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm = tiny_causal_lm(model_type, **overrides).train()

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=tokens).logits

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            loss = self.lm(input_ids=tokens, labels=tokens).loss
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr)

    return LitCausalLM()
