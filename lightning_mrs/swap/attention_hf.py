"""QK-norms for Hugging Face transformers attention, without copying any family's attention code.

A transformers attention layer (``LlamaAttention``, ``GPT2Attention``...) computes its queries
and keys with projections and reshapes them to heads inside its forward, then applies the
rotary embedding and calls the attention kernel. Rather than re-stating each family's forward
(as :mod:`lightning_mrs.swap.attention_torchvision` does for torchvision's few classes), the
swap leaves the layer and its projections as they are and hooks the *projections' outputs*
(:mod:`lightning_mrs.swap.qk_hooks`): the layer's own ``q_norm``/``k_norm`` children apply head
by head to what the projection returns, whatever module holds the projection (PEFT's LoRA
wrapper, a quantized linear, accelerate's hooked forward). The family's forward then reshapes,
rotates (RoPE) and attends as before, so the QK-norm sits on the per-head queries and keys
*before* the rotary embedding, where Qwen3 and Gemma 3 put theirs. With ``q_norm = k_norm =
Identity`` (what :func:`~lightning_mrs.swap.expose_attention` builds) the outputs are the
original's exactly (``tests/swap/test_attention_hf.py``, float64).

Where q and k come from (``head_dim`` and the q/kv head counts are read from the module and
its projections; grouped-query attention included):

===================================  ================================================
``q_proj`` + ``k_proj``              any family (Llama, Mistral, Qwen2, Gemma 1/2, ...):
                                     q heads ``q_proj.out_features / head_dim``, kv heads
                                     likewise
``Phi3Attention.qkv_proj``           ``[q (H heads) | k (Hkv) | v (Hkv)]``
``GPT2Attention.c_attn`` (Conv1D)    ``[q | k | v]``, ``num_heads`` each
``GPTNeoXAttention.query_key_value`` per head ``[q | k | v]``: ``(H, 3, head_size)``
===================================  ================================================

Families with a QK-norm of their own are covered as they are: per-head ``q_norm``/``k_norm``
(Qwen3: on ``(B, N, H, D)``, Gemma 3: on ``(B, H, N, D)``) and ``q_layernorm``/``k_layernorm``
(Phi and Persimmon with ``qk_layernorm=True``, LFM2; Hunyuan's ``query_layernorm``/``key_layernorm``) are swapped in place like
timm's, never doubled. OLMo 2 (and any layer whose ``q_norm`` is as wide as the whole
projection) normalises all heads at once: its norms are swapped keeping that width (one scale
over all heads, as OLMo 2 designed it; a note in the report says so) and the monitor reads q
and k as ``"BN(HD)"``.

Not covered, and reported with the reason: cross-attention (GPT-2's ``q_attn``), fused
projections of other layouts, attention with no ``q_proj``/``k_proj`` (DeepSeek's MLA...), a
layer with only one of a QK pair, and a QK-norm module that is not a norm
(StableLM's per-head ``ModuleList``: its inner LayerNorms are body norms and follow ``target``).

This module never imports transformers (the ``[hf]`` extra is optional): it is loaded only for
a model holding a module whose class comes from transformers (``type(m).__module__``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

from torch import Tensor, nn

from lightning_mrs.swap.attention_info import QK_ATTR_PAIRS, AttentionInfo
from lightning_mrs.swap.qk_hooks import Wiring, attach, qk_state
from lightning_mrs.swap.registry import norm_spec

__all__ = ["HFLayer", "classify", "wiring_of"]

#: native per-head QK-norms: the layout of the tensor they see (checked in the tests)
_NATIVE_LAYOUTS = {"Qwen3Attention": "BNHD", "Qwen3MoeAttention": "BNHD", "Gemma3Attention": "BHND",
                   "PhiAttention": "BHND", "PersimmonAttention": "BHND"}
#: families covered by name (fused projections); any other class must have q_proj and k_proj
_TESTED = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "GemmaAttention", "Gemma2Attention",
           "Phi3Attention", "GPT2Attention", "GPTNeoXAttention", "PhiAttention")


def _is_conv1d(cls: type) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections), recognised without importing transformers."""
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


# ---------------------------------------------------------------------------- the families
def _out(proj: Optional[nn.Module]) -> Optional[int]:
    """The output width of a projection: ``nn.Linear``, GPT-2's ``Conv1D``, or any module with an
    int ``out_features`` (PEFT's ``lora.Linear``, bitsandbytes' linears)."""
    if proj is None:
        return None
    if _is_conv1d(type(proj)):
        return int(proj.nf)
    out = getattr(proj, "out_features", None)
    return out if isinstance(out, int) and not isinstance(out, bool) else None


def _config_heads(module: nn.Module) -> tuple[Optional[int], Optional[int]]:
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    return heads, getattr(config, "num_key_value_heads", None) or heads


def wiring_of(module: nn.Module) -> Union[Wiring, str]:
    """How ``module``'s q and k can be normalised per head, or why they cannot."""
    cls = type(module).__name__
    children = module._modules
    if cls == "GPT2Attention":
        if getattr(module, "is_cross_attention", False):
            return "GPT-2 cross-attention (q from q_attn, k and v from c_attn on the encoder states) is not supported"
        heads, d = int(module.num_heads), int(module.head_dim)
        if _out(children.get("c_attn")) != 3 * heads * d:
            return f"c_attn is not a Conv1D of 3 x {heads} x {d} outputs"
        return Wiring({"c_attn": (("q", heads), ("k", heads), (None, heads))}, d)
    if cls == "GPTNeoXAttention":
        d = int(module.head_size)
        out = _out(children.get("query_key_value"))
        if out is None or out % (3 * d):
            return f"query_key_value is not an nn.Linear of 3 x heads x {d} outputs"
        heads = out // (3 * d)
        return Wiring({"query_key_value": (("q", heads), ("k", heads), (None, heads))}, d, interleaved=True)
    if cls == "Phi3Attention":
        d = int(module.head_dim)
        heads, kv = _config_heads(module)
        if heads is None or _out(children.get("qkv_proj")) != (heads + 2 * kv) * d:
            return f"qkv_proj is not an nn.Linear of (heads + 2 kv heads) x {d} outputs"
        return Wiring({"qkv_proj": (("q", heads), ("k", kv), (None, kv))}, d)
    d = getattr(module, "head_dim", None)
    q_out, k_out = _out(children.get("q_proj")), _out(children.get("k_proj"))
    if q_out is None or k_out is None or not isinstance(d, int):
        fused = [n for n in ("qkv_proj", "c_attn", "query_key_value", "Wqkv", "qkv") if n in children]
        if fused:
            return (f"its fused q/k/v projection {fused[0]!r} has a layout this swap does not know; "
                    "lightning_mrs.swap.register_attention(cls) a subclass that applies q_norm/k_norm per head")
        return ("it has no q_proj/k_proj linear projections and int head_dim to normalise per head (e.g. latent attention); "
                "lightning_mrs.swap.register_attention(cls) a subclass that applies q_norm/k_norm per head")
    if q_out % d or k_out % d:
        return f"q_proj/k_proj outputs ({q_out}, {k_out}) are not multiples of head_dim {d}"
    return Wiring({"q_proj": (("q", q_out // d),), "k_proj": (("k", k_out // d),)}, d)


def _has_rope(module: nn.Module) -> bool:
    return "position_embeddings" in inspect.signature(type(module).forward).parameters


def _unseen(module: nn.Module) -> Optional[str]:
    """What a transformers layer adds to ``scaling * q . k`` that a hook on q_norm/k_norm does not see."""
    terms = []
    if _has_rope(module):
        terms.append("rotary embeddings")
    if getattr(module, "is_causal", False):
        terms.append("the causal mask")
    if getattr(module, "sliding_window", None):
        terms.append("a sliding window")
    if getattr(module, "attn_logit_softcapping", None):
        terms.append("logit soft-capping")
    return " and ".join(terms) or None


def _scale(module: nn.Module) -> Optional[float]:
    scaling = getattr(module, "scaling", None)
    return float(scaling) if isinstance(scaling, (int, float)) else None


def _wired_info(module: nn.Module) -> AttentionInfo:
    wiring = qk_state(module).wiring
    spec = norm_spec(module.q_norm)
    return AttentionInfo(num_heads=wiring.q_heads, head_dim=wiring.head_dim, scale=_scale(module),
                         qk_norm=spec.kind if spec is not None else None, layout="BNHD", unseen=_unseen(module))


def _native_info(module: nn.Module, layout: str, attrs: tuple[str, str]) -> AttentionInfo:
    spec = norm_spec(getattr(module, attrs[0]))
    heads, _ = _config_heads(module)
    return AttentionInfo(num_heads=int(heads), head_dim=int(module.head_dim), scale=_scale(module),
                         qk_norm=spec.kind if spec is not None else None, layout=layout, unseen=_unseen(module),
                         qk_attrs=attrs)


@dataclass(frozen=True)
class HFLayer:
    """What :func:`classify` found: covered as it is (``info`` reads its :class:`AttentionInfo`,
    ``qk_attrs`` name its QK-norms), to wire (``attach``: hooks on its projections,
    :mod:`lightning_mrs.swap.qk_hooks`), or opaque (``reason``); ``note`` is for the swap report."""

    info: Optional[Callable[[nn.Module], AttentionInfo]] = None
    attach: Optional[Callable[[nn.Module], None]] = None
    head_dim: Optional[int] = None
    label: Optional[str] = None
    qk_attrs: tuple[str, str] = QK_ATTR_PAIRS[0]
    reason: Optional[str] = None
    note: Optional[str] = None


def _native_pair(module: nn.Module) -> Union[tuple[str, str], str, None]:
    """The attribute names of ``module``'s own QK-norms, a reason when only one of a pair is
    there, or ``None``."""
    for q, k in QK_ATTR_PAIRS:
        has_q, has_k = isinstance(module._modules.get(q), nn.Module), isinstance(module._modules.get(k), nn.Module)
        if has_q and has_k:
            return q, k
        if has_q or has_k:
            return f"it has {q if has_q else k} but no {k if has_q else q}: not a QK-norm pair the swap can use"
    return None


def classify(module: nn.Module, looks_like_attention: bool) -> Optional[HFLayer]:
    """``module`` (whose class comes from transformers) as an attention layer, or ``None`` when
    it is not one."""
    if qk_state(module) is not None:
        return HFLayer(info=_wired_info)
    cls = type(module).__name__
    pair = _native_pair(module)
    if isinstance(pair, str):
        return HFLayer(reason=f"{type(module).__module__}.{type(module).__qualname__}: {pair}")
    if pair is not None:
        q_norm = module._modules[pair[0]]
        spec, weight = norm_spec(q_norm), getattr(q_norm, "weight", None)
        width = spec.num_channels if spec is not None else (
            weight.shape[0] if isinstance(weight, Tensor) and weight.ndim == 1 else None)
        d = getattr(module, "head_dim", None)
        heads, _ = _config_heads(module)
        if width is not None and isinstance(d, int) and heads and width == heads * d and width != d:
            return HFLayer(info=lambda m: _native_info(m, "BN(HD)", pair), qk_attrs=pair, note=(
                f"{cls}'s {pair[0]}/{pair[1]} normalise the whole q/k projection ({heads} heads x {d} at once, as "
                "OLMo 2 does), not each head: they keep that width (one scale over all heads)"))
        layout = _NATIVE_LAYOUTS.get(cls, "unknown")
        return HFLayer(info=lambda m: _native_info(m, layout, pair), qk_attrs=pair)
    if not looks_like_attention:
        return None
    wiring = wiring_of(module)
    if isinstance(wiring, str):
        return HFLayer(reason=f"{type(module).__module__}.{type(module).__qualname__}: {wiring}")
    note = None if cls in _TESTED else (
        f"{cls}: QK-norms added by the generic q_proj/k_proj rule (a family the tests do not cover; check that its "
        "forward reshapes q_proj/k_proj outputs to heads of head_dim before the logits)")
    label = f"{type(module).__qualname__} with per-head QK-norms on {'+'.join(wiring.projections)} (hooks)"
    return HFLayer(attach=lambda m: attach(m, wiring), head_dim=wiring.head_dim, label=label, note=note)
