"""QK-norms for Hugging Face transformers attention, without copying any family's attention code.

A transformers attention layer (``LlamaAttention``, ``GPT2Attention``...) computes its queries
and keys with projections and reshapes them to heads inside its forward, then applies the
rotary embedding and calls the attention kernel. Rather than re-stating each family's forward
(as :mod:`lightning_mrs.swap.attention_torchvision` does for torchvision's few classes), the
swap wraps the *projections* that produce q and k: :class:`QKNormLinear` (``nn.Linear``) and
:class:`QKNormConv1D` (GPT-2's ``Conv1D``) compute the projection with the same parameter
objects (same state-dict keys), then apply the attention layer's own ``q_norm``/``k_norm``
children head by head to their outputs. The family's forward then reshapes, rotates (RoPE)
and attends as before, so the QK-norm sits on the per-head queries and keys *before* the
rotary embedding, where Qwen3 and Gemma 3 put theirs. With ``q_norm = k_norm = Identity``
(what :func:`~lightning_mrs.swap.expose_attention` builds) the outputs are the original's
exactly (``tests/swap/test_attention_hf.py``, float64).

Where q and k come from (``head_dim`` and the q/kv head counts are read from the module and
its projections; grouped-query attention included):

===================================  ================================================
``q_proj`` + ``k_proj`` (``nn.Linear``)  any family (Llama, Mistral, Qwen2, Gemma 1/2, ...):
                                     q heads ``q_proj.out_features / head_dim``, kv heads
                                     likewise
``Phi3Attention.qkv_proj``           ``[q (H heads) | k (Hkv) | v (Hkv)]``
``GPT2Attention.c_attn`` (Conv1D)    ``[q | k | v]``, ``num_heads`` each
``GPTNeoXAttention.query_key_value`` per head ``[q | k | v]``: ``(H, 3, head_size)``
===================================  ================================================

Families with a QK-norm of their own are covered as they are: per-head ``q_norm``/``k_norm``
(Qwen3: on ``(B, N, H, D)``, Gemma 3: on ``(B, H, N, D)``) are swapped like timm's. OLMo 2 (and
any layer whose ``q_norm`` is as wide as the whole projection) normalises all heads at once:
its norms are swapped keeping that width (one scale over all heads, as OLMo 2 designed it; a
note in the report says so) and the monitor reads q and k as ``"BN(HD)"``.

Not covered, and reported with the reason: cross-attention (GPT-2's ``q_attn``), fused
projections of other layouts, attention with no ``q_proj``/``k_proj`` (DeepSeek's MLA...), and a
``q_norm`` of a width that is neither ``head_dim`` nor the whole projection.

This module imports transformers; :mod:`lightning_mrs.swap.attention` imports it only when a
model holds a module whose class comes from transformers (``type(m).__module__``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from lightning_mrs.swap.attention_info import QK_ATTRS, AttentionInfo
from lightning_mrs.swap.registry import norm_spec

__all__ = ["HFLayer", "QKNormConv1D", "QKNormLinear", "classify", "rewire_attention"]

#: native per-head QK-norms: the layout of the tensor they see (checked in the tests)
_NATIVE_LAYOUTS = {"Qwen3Attention": "BNHD", "Qwen3MoeAttention": "BNHD", "Gemma3Attention": "BHND"}
#: families covered by name (fused projections); any other class must have q_proj and k_proj
_TESTED = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "GemmaAttention", "Gemma2Attention",
           "Phi3Attention", "GPT2Attention", "GPTNeoXAttention")

Split = tuple[tuple[Optional[str], int], ...]  # (role "q"/"k" or None, heads) along the last dim, in order


class _HeadNormOutput:
    """Mixin: the projection's output with the owner's ``q_norm``/``k_norm`` applied per head.

    ``split`` lists the segments of the output's last dim; ``interleaved`` reads it as
    ``(heads, segments, head_dim)`` instead (GPT-NeoX). The owner (the attention layer) is held
    in a tuple, not as a child: its norms stay registered once, under ``<layer>.q_norm``.
    """

    _qk_owner: tuple[nn.Module]
    _qk_split: Split
    _qk_head_dim: int
    _qk_interleaved: bool

    @classmethod
    def from_module(cls, module: nn.Module, owner: nn.Module, split: Split, head_dim: int,
                    interleaved: bool = False) -> nn.Module:
        """``module`` as this class, around the same parameter objects (same state-dict keys)."""
        new = cls.__new__(cls)
        new.__dict__.update(module.__dict__)  # hooks dicts are shared: handles still remove them
        for key in ("_parameters", "_buffers", "_modules"):
            new.__dict__[key] = type(module.__dict__[key])(module.__dict__[key])  # own dicts, same tensors
        new._qk_owner = (owner,)
        new._qk_split, new._qk_head_dim, new._qk_interleaved = tuple(split), int(head_dim), bool(interleaved)
        return new

    def heads(self, role: str) -> int:
        """The heads of ``role`` (``"q"``/``"k"``) this projection produces (0 if none)."""
        return sum(h for r, h in self._qk_split if r == role)

    def forward(self, x: Tensor) -> Tensor:
        return self._qk_apply(super().forward(x))  # type: ignore[misc]

    def _qk_apply(self, y: Tensor) -> Tensor:
        owner, d = self._qk_owner[0], self._qk_head_dim
        if self._qk_interleaved:
            heads = self._qk_split[0][1]
            t = y.unflatten(-1, (heads, len(self._qk_split), d))  # (..., H, parts, D)
            parts = [t[..., i, :] if role is None else getattr(owner, f"{role}_norm")(t[..., i, :])
                     for i, (role, _) in enumerate(self._qk_split)]  # (..., H, D) each
            return torch.stack(parts, dim=-2).flatten(-3)
        chunks = y.split([h * d for _, h in self._qk_split], dim=-1) if len(self._qk_split) > 1 else (y,)
        parts = [c if role is None else getattr(owner, f"{role}_norm")(c.unflatten(-1, (h, d))).flatten(-2)
                 for (role, h), c in zip(self._qk_split, chunks)]  # (..., H, D) per head inside
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def extra_repr(self) -> str:
        segments = ", ".join(f"{r or 'v'}: {h}x{self._qk_head_dim}" for r, h in self._qk_split)
        how = "interleaved per head" if self._qk_interleaved else "per head"
        return f"{super().extra_repr()}, qk_norm {how} ({segments})"  # type: ignore[misc]


class QKNormLinear(_HeadNormOutput, nn.Linear):
    """An ``nn.Linear`` q/k projection whose output goes through the owner's ``q_norm``/``k_norm`` per head."""


class QKNormConv1D(_HeadNormOutput, Conv1D):
    """GPT-2's ``Conv1D`` q/k/v projection, with ``q_norm``/``k_norm`` per head on its q and k parts."""


_WRAPPERS: dict[type, type] = {nn.Linear: QKNormLinear, Conv1D: QKNormConv1D}


def _wrap(proj: nn.Module, owner: nn.Module, split: Split, head_dim: int, interleaved: bool = False) -> nn.Module:
    return _WRAPPERS[type(proj)].from_module(proj, owner, split, head_dim, interleaved)


# ---------------------------------------------------------------------------- the families
@dataclass(frozen=True)
class _Wiring:
    """Where a layer's q and k come from: projection attribute -> its split."""

    projections: dict[str, Split]
    head_dim: int
    interleaved: bool = False

    @property
    def q_heads(self) -> int:
        return sum(h for split in self.projections.values() for r, h in split if r == "q")


def _out(proj: nn.Module) -> Optional[int]:
    if type(proj) is nn.Linear:
        return proj.out_features
    if type(proj) is Conv1D:
        return int(proj.nf)
    return None


def _config_heads(module: nn.Module) -> tuple[Optional[int], Optional[int]]:
    config = getattr(module, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    return heads, getattr(config, "num_key_value_heads", None) or heads


def _wiring(module: nn.Module) -> Union[_Wiring, str]:
    """How ``module``'s q and k can be normalised per head, or why they cannot."""
    cls = type(module).__name__
    children = module._modules
    if cls == "GPT2Attention":
        if getattr(module, "is_cross_attention", False):
            return "GPT-2 cross-attention (q from q_attn, k and v from c_attn on the encoder states) is not supported"
        heads, d = int(module.num_heads), int(module.head_dim)
        if _out(children.get("c_attn")) != 3 * heads * d:
            return f"c_attn is not a Conv1D of 3 x {heads} x {d} outputs"
        return _Wiring({"c_attn": (("q", heads), ("k", heads), (None, heads))}, d)
    if cls == "GPTNeoXAttention":
        d = int(module.head_size)
        out = _out(children.get("query_key_value"))
        if out is None or out % (3 * d):
            return f"query_key_value is not an nn.Linear of 3 x heads x {d} outputs"
        heads = out // (3 * d)
        return _Wiring({"query_key_value": (("q", heads), ("k", heads), (None, heads))}, d, interleaved=True)
    if cls == "Phi3Attention":
        d = int(module.head_dim)
        heads, kv = _config_heads(module)
        if heads is None or _out(children.get("qkv_proj")) != (heads + 2 * kv) * d:
            return f"qkv_proj is not an nn.Linear of (heads + 2 kv heads) x {d} outputs"
        return _Wiring({"qkv_proj": (("q", heads), ("k", kv), (None, kv))}, d)
    d = getattr(module, "head_dim", None)
    q_out, k_out = _out(children.get("q_proj")), _out(children.get("k_proj"))
    if q_out is None or k_out is None or not isinstance(d, int):
        fused = [n for n in ("qkv_proj", "c_attn", "query_key_value", "Wqkv", "qkv") if n in children]
        if fused:
            return (f"its fused q/k/v projection {fused[0]!r} has a layout this swap does not know; "
                    "lightning_mrs.swap.register_attention(cls) a subclass that applies q_norm/k_norm per head")
        return ("it has no q_proj/k_proj nn.Linear and int head_dim to normalise per head (e.g. latent attention); "
                "lightning_mrs.swap.register_attention(cls) a subclass that applies q_norm/k_norm per head")
    if q_out % d or k_out % d:
        return f"q_proj/k_proj outputs ({q_out}, {k_out}) are not multiples of head_dim {d}"
    return _Wiring({"q_proj": (("q", q_out // d),), "k_proj": (("k", k_out // d),)}, d)


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


def _wrapped(module: nn.Module) -> list[_HeadNormOutput]:
    return [m for m in module._modules.values() if isinstance(m, _HeadNormOutput) and m._qk_owner[0] is module]


def _wrapped_info(module: nn.Module) -> AttentionInfo:
    wrapped = _wrapped(module)
    spec = norm_spec(module.q_norm)
    return AttentionInfo(num_heads=sum(w.heads("q") for w in wrapped), head_dim=wrapped[0]._qk_head_dim,
                         scale=_scale(module), qk_norm=spec.kind if spec is not None else None, layout="BNHD",
                         unseen=_unseen(module))


def _native_info(module: nn.Module, layout: str) -> AttentionInfo:
    spec = norm_spec(module.q_norm)
    heads, _ = _config_heads(module)
    return AttentionInfo(num_heads=int(heads), head_dim=int(module.head_dim), scale=_scale(module),
                         qk_norm=spec.kind if spec is not None else None, layout=layout, unseen=_unseen(module))


@dataclass(frozen=True)
class HFLayer:
    """What :func:`classify` found: covered as it is (``info`` reads its :class:`AttentionInfo`),
    to rewire (``replacement``), or opaque (``reason``); ``note`` is for the swap report."""

    info: Optional[Callable[[nn.Module], AttentionInfo]] = None
    replacement: Optional["_Rewire"] = None
    reason: Optional[str] = None
    note: Optional[str] = None


class _Rewire:
    """The replacement "class" of one layer for :func:`~lightning_mrs.swap.attention.plan_attention`."""

    def __init__(self, module: nn.Module, wiring: _Wiring) -> None:
        self.wiring = wiring
        projections = "+".join(wiring.projections)
        self.__qualname__ = f"{type(module).__qualname__} with per-head QK-norms on {projections}"
        self.label = self.__qualname__

    def from_module(self, module: nn.Module) -> nn.Module:
        return rewire_attention(module, self.wiring)


def rewire_attention(module: nn.Module, wiring: Optional[_Wiring] = None) -> nn.Module:
    """A copy of ``module`` (same class, same parameter objects) whose q/k projections are
    wrapped and whose ``q_norm``/``k_norm`` are ``nn.Identity`` (outputs unchanged)."""
    wiring = _wiring(module) if wiring is None else wiring
    if isinstance(wiring, str):
        raise ValueError(f"{type(module).__qualname__}: {wiring}")
    new = module.__class__.__new__(module.__class__)
    new.__dict__.update(module.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        new.__dict__[key] = type(module.__dict__[key])(module.__dict__[key])
    for attr, split in wiring.projections.items():
        new._modules[attr] = _wrap(module._modules[attr], new, split, wiring.head_dim, wiring.interleaved)
    new.q_norm = nn.Identity()
    new.k_norm = nn.Identity()
    if not isinstance(getattr(new, "head_dim", None), int):
        new.head_dim = wiring.head_dim  # GPT-NeoX calls it head_size; the swap reads head_dim
    return new


def is_transformers(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def classify(module: nn.Module, looks_like_attention: bool) -> Optional[HFLayer]:
    """``module`` (whose class comes from transformers) as an attention layer, or ``None`` when
    it is not one."""
    if _wrapped(module):
        return HFLayer(info=_wrapped_info)
    q_norm, k_norm = (module._modules.get(a) for a in QK_ATTRS)
    cls = type(module).__name__
    if q_norm is not None and k_norm is not None:
        spec, weight = norm_spec(q_norm), getattr(q_norm, "weight", None)
        width = spec.num_channels if spec is not None else (
            weight.shape[0] if isinstance(weight, Tensor) and weight.ndim == 1 else None)
        d = getattr(module, "head_dim", None)
        heads, _ = _config_heads(module)
        if width is not None and isinstance(d, int) and heads and width == heads * d and width != d:
            return HFLayer(info=lambda m: _native_info(m, "BN(HD)"), note=(
                f"{cls}'s q_norm/k_norm normalise the whole q/k projection ({heads} heads x {d} at once, as OLMo 2 "
                "does), not each head: they keep that width (one scale over all heads)"))
        layout = _NATIVE_LAYOUTS.get(cls, "unknown")
        return HFLayer(info=lambda m: _native_info(m, layout))
    if not looks_like_attention:
        return None
    wiring = _wiring(module)
    if isinstance(wiring, str):
        return HFLayer(reason=f"{type(module).__module__}.{type(module).__qualname__}: {wiring}")
    note = None if cls in _TESTED else (
        f"{cls}: QK-norms added by the generic q_proj/k_proj rule (a family the tests do not cover; check that its "
        "forward reshapes q_proj/k_proj outputs to heads of head_dim before the logits)")
    return HFLayer(replacement=_Rewire(module, wiring), note=note)
