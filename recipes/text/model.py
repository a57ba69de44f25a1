"""The language-model recipe's model, built in one place: a transformers causal LM from a config
(:mod:`recipes.text.causal_lm`, checked before any weight exists; bytes are the tokens) or from a
pretrained checkpoint (:mod:`recipes.text.pretrained`; its tokenizer's tokens), then the norm swap
and its check (:mod:`recipes.text.checks`). :class:`recipes.text.byte_lm.ByteLM` calls it.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from torch import nn

from lightning_mrs import MRSNorm, SwapOptions, SwapReport, swap_norms
from recipes.text.causal_lm import build_causal_lm, head_size
from recipes.common.errors import UsageError
from recipes.text.checks import check_swap
from recipes.text.pretrained import load_pretrained

__all__ = ["build_byte_model"]


def build_byte_model(arch: str, config: Optional[dict[str, Any]], norm: str, qk_norm: str, mrs_backend: str,
                     seq_len: int, attn_implementation: Optional[str] = None,
                     pretrained: Optional[str] = None) -> tuple[nn.Module, Optional[SwapReport]]:
    """The model and its swap report: ``arch``'s config with ``config`` (checked) and random weights,
    or the ``pretrained`` checkpoint; its norms swapped to ``norm`` (``none``: kept) with a ``qk_norm``
    QK-norm added, and every MRSNorm on ``mrs_backend``.

    Raises:
        UsageError: a config :func:`recipes.text.causal_lm.build_config` refuses, a pretrained checkpoint
            :func:`recipes.text.pretrained.load_pretrained` cannot load, an MRS QK-norm on heads of odd
            width, or a swap that converts nothing (:func:`recipes.text.checks.check_swap`).
    """
    if pretrained is not None:
        model = load_pretrained(pretrained, seq_len, attn_implementation)
        arch = model.config.model_type
    else:
        model = build_causal_lm(arch, config, seq_len, attn_implementation)
    hf_config = getattr(model, "config", None)
    width = head_size(hf_config) if hf_config is not None else None
    if qk_norm == "mrs" and width is not None and width % 2:
        raise UsageError(f"--model.qk_norm mrs: MRSNorm pairs each head's channels into phasors, and the {arch} "
                         f"model's attention heads are {width} wide (odd); give an even head_dim (or hidden_size / "
                         "num_attention_heads) in --model.config, or --model.qk_norm rms or layer.")
    report = None
    if norm != "none" or qk_norm != "none":
        options = SwapOptions(None if norm == "none" else norm, qk_norm=None if qk_norm == "none" else qk_norm)
        with warnings.catch_warnings(record=True) as caught:  # "converted none" is the error below
            warnings.simplefilter("always")
            report = swap_norms(model, options)
        check_swap(model, arch, norm, qk_norm, report)
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    for module in model.modules():
        if isinstance(module, MRSNorm):
            module.backend = mrs_backend
    return model, report

