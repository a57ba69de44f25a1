"""QK-norm for any transformer: find the attention layers, add a per-head norm on q and k.

MRSNorm on the queries and keys ("phasor attention",
``docs/method.md#phasor-attention-qk-norm``) turns each attention logit into an energy-weighted
cosine: per head, ``q_hat . k_hat = sum_i g_q,i g_k,i |q_i| |k_i| cos(theta_q,i - theta_k,i) /
(S_q S_k)``. Since ``sum_i |q_i| / S_q = P`` (``P = head_dim / 2`` phasors), a
logit is at most ``max(g)^2 P^2`` times the logit scale whatever the size of q and k: one
outlier can no longer saturate the softmax. ``swap_norms(model, target, qk_norm=...)`` adds one
(see :class:`~lightning_mrs.swap.options.SwapOptions`); this module finds the layers and plans it.

The attention-layer protocol (what the attention monitor relies on). Every *covered* layer has

* ``q_norm`` and ``k_norm`` submodules (``nn.Identity`` until a QK-norm is added) applied to
  the per-head queries and keys right after the projection and head split, before the logits
  ``q @ k^T`` or the fused ``scaled_dot_product_attention``: a forward hook on them (Identity
  included) sees q and k. Their last dim is ``head_dim``; the layout of the other dims is
  :attr:`AttentionInfo.layout`: ``"BHND"`` ``(B, heads, N, head_dim)`` for nearly all,
  ``"BNHD"`` for timm's ``ParallelScalingBlock`` and ``Gemma4Attention``, ``"(BH)ND"`` for
  timm's SAM ``Attention``. Windowed attention folds the windows into B (Swin: ``B*windows``;
  MaxViT: ``B*groups``).
* :func:`iter_attention_layers` gives ``(dotted name, module, AttentionInfo)`` with the number
  of heads, ``head_dim``, the logit scale and the QK-norm's kind.

Covered (read off each class's forward, timm 1.0.31 / torchvision 0.29):

* timm, as they are: ``timm.layers.Attention`` (ViT, DeiT, DeiT III, PiT, CrossViT's self
  attention, MobileViT v1, NaFlexViT, hybrid ViTs, ViTamin), ``AttentionRope`` (DeepSeek /
  Qwen3 ViTs), ``DiffAttention``, ``AttentionPoolLatent`` (``global_pool="map"``),
  ``SimPool1d``/``SimPool2d``, ``EvaAttention`` (EVA, EVA-02, rope ViTs),
  ``RelPosAttention`` (vit_relpos), SAM's ``Attention`` (samvit), ``ParallelScalingBlock`` and
  ``DiffParallelScalingBlock`` (parallel ViTs), ``Gemma4Attention`` (has RMS QK-norms).
* torch/torchvision, rebuilt by :mod:`lightning_mrs.swap.attention_torchvision` with the same
  parameters: ``nn.MultiheadAttention`` (torchvision ViT, ``nn.TransformerEncoderLayer``...),
  Swin's ``ShiftedWindowAttention``/``ShiftedWindowAttentionV2``, MaxViT's
  ``RelativePositionalMultiHeadAttention`` (:func:`expose_attention` does only this).
* Hugging Face transformers, by :mod:`lightning_mrs.swap.attention_hf` (loaded only for a model
  holding a module whose class comes from transformers): the q/k projections are wrapped so
  that ``q_norm``/``k_norm`` apply per head before the rotary embedding (Llama, Mistral, Qwen2,
  Gemma 1/2, Phi-3, GPT-2, GPT-NeoX, and any layer with ``q_proj``/``k_proj`` and ``head_dim``);
  the QK-norms of Qwen3, Gemma 3 and OLMo 2 (full-width, ``"BN(HD)"``) are covered as they are.

Other modules that look like attention (a class name with Attention/Attn/XCA/MSA and a
``num_heads``-like int: BEiT, CaiT, XCiT, MViTv2, timm's Swin...) compute q and k where no
hook can reach; a QK-norm swap reports them as skipped. :func:`register_attention` adds your
own class that applies ``q_norm``/``k_norm`` per head.

Example:
    >>> import timm
    >>> from lightning_mrs import swap_norms
    >>> vit = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2)
    >>> report = swap_norms(vit, target=None, qk_norm="mrs")  # MRS QK-norms, LayerNorms kept
    >>> [(name, info.qk_norm) for name, _, info in iter_attention_layers(vit)]
    [('blocks.0.attn', 'mrs'), ('blocks.1.attn', 'mrs')]
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from torch import nn

from lightning_mrs.modules import MRSNorm
from lightning_mrs.swap.attention_info import QK_ATTRS, AttentionInfo
from lightning_mrs.swap.build import DEFAULT_EPS, accelerate_hooked
from lightning_mrs.swap.hf import is_transformers
from lightning_mrs.swap.options import SwapOptions
from lightning_mrs.swap.registry import norm_spec
from lightning_mrs.swap.report import SwapReport
from lightning_mrs.swap.rewire import rewire

__all__ = ["AttentionInfo", "QKPlan", "expose_attention", "iter_attention_layers", "plan_attention",
           "QK_ATTRS", "register_attention"]

_LOOKS_LIKE = re.compile(r"attn|attention|xca|msa", re.IGNORECASE)
_HEAD_ATTRS = ("num_heads", "n_heads", "heads", "nhead")
_QK_NORMS: dict[str, Callable[..., nn.Module]] = {
    "mrs": lambda c, eps, dd: MRSNorm(c, eps, **dd),
    "rms": lambda c, eps, dd: nn.RMSNorm(c, eps, **dd),
    "layer": lambda c, eps, dd: nn.LayerNorm(c, eps, **dd),
}


@dataclass(frozen=True)
class _Entry:
    layout: str = "BHND"
    head_factor: int = 1  # q heads per module.num_heads (differential attention: 2)
    cosine: bool = False
    scale: Optional[float] = None  # a fixed logit scale where the module has no ``scale``
    info: Optional[Callable[[nn.Module], AttentionInfo]] = None  # the layer's info, where it is read differently


_ATTENTION_CLASSES: dict[type, _Entry] = {}
_REPLACEMENTS: dict[type, type] = {}
_LOADED = False


def register_attention(cls: type, *, layout: str = "BHND", head_factor: int = 1, cosine: bool = False) -> None:
    """Declare that ``cls`` applies its ``q_norm``/``k_norm`` children per head, before the logits.

    Instances must have int ``num_heads`` and ``head_dim`` attributes (the q/k tensors' last
    dim) and a ``scale`` (float, or ``None`` when learned).

    Example:
        >>> class MyAttention(nn.Module):  # computes q_norm(q), k_norm(k) on (B, H, N, D)
        ...     pass
        >>> register_attention(MyAttention)
    """
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise TypeError(f"register_attention: cls must be an nn.Module subclass, got {cls!r}.")
    _ATTENTION_CLASSES[cls] = _Entry(layout, head_factor, cosine)


def _load_builtins() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from lightning_mrs.swap.attention_mha import QKMultiheadAttention

    _REPLACEMENTS[nn.MultiheadAttention] = QKMultiheadAttention
    _ATTENTION_CLASSES.setdefault(QKMultiheadAttention, _Entry())
    if importlib.util.find_spec("torchvision") is not None:  # optional: a language-model user may not have it
        from lightning_mrs.swap import attention_torchvision as tv

        _REPLACEMENTS.update(tv.REPLACEMENTS)
        for qk_cls in tv.REPLACEMENTS.values():
            _ATTENTION_CLASSES.setdefault(qk_cls, _Entry(cosine=qk_cls is tv.QKShiftedWindowAttentionV2))
    timm_classes = {
        "timm.layers.attention": ("Attention", "AttentionRope"),
        "timm.layers.attention_pool": ("AttentionPoolLatent",),
        "timm.layers.diff_attention": ("DiffAttention",),
        "timm.layers.other_pool": ("SimPool1d", "SimPool2d"),
        "timm.models.eva": ("EvaAttention",),
        "timm.models.vision_transformer": ("ParallelScalingBlock", "DiffParallelScalingBlock"),
        "timm.models.vision_transformer_relpos": ("RelPosAttention",),
        "timm.models.vision_transformer_sam": ("Attention",),
        "timm.models.gemma4_vit": ("Gemma4Attention",),
    }
    special = {"ParallelScalingBlock": _Entry("BNHD"), "Gemma4Attention": _Entry("BNHD", scale=1.0),
               "DiffAttention": _Entry(head_factor=2), "DiffParallelScalingBlock": _Entry(head_factor=2)}
    for module_name, names in timm_classes.items():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - timm is optional; older versions lack some classes
            continue
        for name in names:
            cls = getattr(module, name, None)
            if isinstance(cls, type):
                entry = _Entry("(BH)ND") if module_name.endswith("_sam") else special.get(name, _Entry())
                _ATTENTION_CLASSES.setdefault(cls, entry)  # a user's register_attention wins


def _entry(module: nn.Module) -> tuple[Optional[_Entry], Optional[str]]:
    """The registry entry of ``module`` (MRO walk), or why it is opaque."""
    cls = type(module)
    for i, klass in enumerate(cls.__mro__):
        entry = _ATTENTION_CLASSES.get(klass)
        if entry is None:
            continue
        if any("forward" in vars(sub) for sub in cls.__mro__[:i]):
            return None, (f"{cls.__qualname__} subclasses {klass.__qualname__} but overrides forward, so where "
                          "q and k are normalised is unknown; lightning_mrs.swap.register_attention(cls) if it "
                          "applies q_norm/k_norm per head before the logits")
        return entry, None
    return None, None


@dataclass
class _Layer:
    name: str
    module: nn.Module
    entry: Optional[_Entry] = None  # covered as it is
    replacement: Optional[type] = None  # rebuilt by attention_torchvision
    attach: Optional[Callable[[nn.Module], None]] = None  # hooked in place by attention_hf (qk_hooks)
    head_dim: Optional[int] = None  # an attach layer's head width
    label: Optional[str] = None  # an attach layer's description in the report
    qk_attrs: tuple[str, str] = QK_ATTRS  # where the layer holds its QK-norms
    reason: Optional[str] = None  # opaque: why no QK-norm can be added
    note: Optional[str] = None  # for the report when a QK-norm is asked for

    @property
    def changes_layer(self) -> bool:
        """A QK-norm needs the layer rebuilt or hooked (it has no ``q_norm``/``k_norm`` slots)."""
        return self.replacement is not None or self.attach is not None


def _find(model: nn.Module) -> list[_Layer]:
    """Every attention layer: covered, replaceable, or opaque (innermost ones only)."""
    _load_builtins()
    found: list[_Layer] = []
    for name, module in model.named_modules():
        if is_transformers(module):  # never imports transformers otherwise
            from lightning_mrs.swap import attention_hf

            hf = attention_hf.classify(module, bool(_LOOKS_LIKE.search(type(module).__name__)))
            if hf is not None:
                entry = _Entry(info=hf.info) if hf.info is not None else None
                found.append(_Layer(name, module, entry, attach=hf.attach, head_dim=hf.head_dim, label=hf.label,
                                    qk_attrs=hf.qk_attrs, reason=hf.reason, note=hf.note))
                continue
        entry, reason = _entry(module)
        if entry is not None:
            found.append(_Layer(name, module, entry=entry))
            continue
        replacement = _REPLACEMENTS.get(type(module))
        if replacement is not None:
            reason = getattr(replacement, "unsupported", lambda m: None)(module)
            if reason is None and accelerate_hooked(module):
                reason = (f"accelerate hooks this {type(module).__qualname__} (its per-instance forward would be "
                          "copied into the rebuilt layer); swap before dispatch_model / device_map")
            found.append(_Layer(name, module, replacement=None if reason else replacement, reason=reason))
        elif reason is not None or isinstance(module, nn.MultiheadAttention):
            found.append(_Layer(name, module, reason=reason or (
                f"{type(module).__qualname__} subclasses nn.MultiheadAttention with its own forward")))
        elif _LOOKS_LIKE.search(type(module).__name__) and any(
                isinstance(getattr(module, a, None), int) for a in _HEAD_ATTRS):
            found.append(_Layer(name, module, reason=(
                f"{type(module).__module__}.{type(module).__qualname__} computes q and k inside its forward with "
                "no q_norm/k_norm to hook (a structure the swap cannot see into)")))
    # an opaque container of attention layers (a block named ...Attention...) is not one itself
    return [f for f in found if f.reason is None or not any(_inside(g.name, f.name) for g in found)]


def _inside(name: str, parent: str) -> bool:
    return name != parent and (not parent or name.startswith(f"{parent}."))


def _info(module: nn.Module, entry: _Entry) -> AttentionInfo:
    if entry.info is not None:
        return entry.info(module)
    spec = norm_spec(module.q_norm)
    scale = getattr(module, "scale", None)
    return AttentionInfo(
        num_heads=int(module.num_heads) * entry.head_factor,
        head_dim=int(module.head_dim),
        scale=float(scale) if isinstance(scale, (int, float)) else entry.scale,
        qk_norm=spec.kind if spec is not None else None,
        layout=entry.layout,
        cosine=entry.cosine,
    )


def iter_attention_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module, AttentionInfo]]:
    """Every covered attention layer of ``model``: ``(dotted name, module, AttentionInfo)``.

    torch/torchvision attention is covered once rebuilt (a QK-norm swap, or
    :func:`expose_attention`); until then it is not yielded.

    Example:
        >>> layer = nn.Sequential(nn.TransformerEncoderLayer(8, 2, batch_first=True))
        >>> _ = expose_attention(layer)
        >>> [(n, i.num_heads, i.head_dim, i.qk_norm) for n, _, i in iter_attention_layers(layer)]
        [('0.self_attn', 2, 4, None)]
    """
    for layer in _find(model):
        if layer.entry is not None:
            yield layer.name, layer.module, _info(layer.module, layer.entry)


def expose_attention(model: nn.Module) -> list[str]:
    """Rebuild every torch/torchvision attention layer with ``q_norm = k_norm = Identity``
    (same parameters, same outputs), so that :func:`iter_attention_layers` and forward hooks
    see q and k without any QK-norm (a baseline run). Returns the names rebuilt.

    Raises:
        ValueError: ``model`` itself is such a layer (wrap it: ``nn.Sequential(attn)``).

    Example:
        >>> model = nn.Sequential(nn.MultiheadAttention(16, 2))
        >>> expose_attention(model)
        ['0']
        >>> type(model[0].q_norm).__name__, [info.qk_norm for _, _, info in iter_attention_layers(model)]
        ('Identity', [None])
    """
    found = _find(model)
    layers = [f for f in found if f.replacement is not None]
    if any(f.module is model for f in layers):
        raise ValueError(f"expose_attention: the model itself is a {type(model).__qualname__} and cannot be "
                         "replaced in place; wrap it (nn.Sequential(attn)).")
    rewire(model, {id(f.module): f.replacement.from_module(f.module) for f in layers})
    hooked = [f for f in found if f.attach is not None]
    for f in hooked:
        f.attach(f.module)  # transformers layers: identity QK-norms on hooks, nothing copied
    return [f.name for f in [*layers, *hooked]]


@dataclass
class QKPlan:
    """What a swap does to the attention layers (made by :func:`plan_attention`).

    Nothing is built while planning: :meth:`apply` rebuilds or hooks the layers once the body's
    norms are in place, from the modules the model holds then (a rebuilt layer made before the
    body swap would keep the discarded norms).

    Attributes:
        targets: ``id`` of an existing QK-norm -> the kind it becomes (``None``: left alone).
        rebuilds: ``id`` of a torch/torchvision attention layer -> ``(layer, its QK class)``.
        attachments: transformers layers to hook in place -> their ``attach``.
        additions: ``(attention layer, attribute, new norm)`` to set once the layers are rebuilt
            or hooked (on the rebuild where there is one).
        problems: why layers got no QK-norm, for reasons other than include/exclude
            (``strict=True`` turns them into an error).
    """

    targets: dict[int, Optional[str]] = field(default_factory=dict)
    rebuilds: dict[int, tuple[nn.Module, type]] = field(default_factory=dict)
    attachments: list[tuple[nn.Module, Callable[[nn.Module], None]]] = field(default_factory=list)
    additions: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def target_of(self, module: nn.Module, target: Optional[str]) -> Optional[str]:
        """The kind ``module`` becomes: its QK-norm kind if it is a QK-norm, else ``target``."""
        return self.targets[id(module)] if id(module) in self.targets else target

    def apply(self, model: nn.Module) -> None:
        """Rebuild or hook the attention layers (after the body swap), then set the new QK-norms."""
        rebuilt = {key: cls.from_module(module) for key, (module, cls) in self.rebuilds.items()}
        rewire(model, rebuilt)
        for module, attach in self.attachments:
            attach(module)
        for module, attr, norm in self.additions:
            setattr(rebuilt.get(id(module), module), attr, norm)


def _new_norm(kind: str, module: nn.Module, head_dim: int, eps: Optional[float]) -> nn.Module:
    params = list(module.parameters())
    floating = [p for p in params if p.is_floating_point()]
    dd = {"device": floating[0].device, "dtype": floating[0].dtype} if floating else {}
    norm = _QK_NORMS[kind](head_dim, DEFAULT_EPS if eps is None else eps, dd)
    # a frozen attention layer gets a frozen QK-norm (the swap's rule for frozen sources)
    norm.requires_grad_(not params or any(p.requires_grad for p in params))
    return norm.train(module.training)


def _child(name: str, attr: str) -> str:
    """The dotted name of ``attr`` of the module named ``name`` (``""``: the model itself)."""
    return f"{name}.{attr}" if name else attr


def plan_attention(
    model: nn.Module,
    opts: SwapOptions,
    report: SwapReport,
    deselected: Callable[[nn.Module, list[str]], Optional[str]],
) -> QKPlan:
    """Plan the QK-norms of ``model`` for ``opts`` and record them in ``report``.

    Nothing of the model changes here; ``deselected(module, names)`` is the swap's
    include/exclude rule (a reason, or ``None``), applied to ``<layer>.q_norm``/``.k_norm``.
    """
    plan = QKPlan()
    if opts.target is None and opts.qk_kind is None:
        report.notes.append(f"target=None and qk_norm={opts.qk_norm!r} ask for nothing: the model is unchanged")
    if opts.qk_norm is None:
        return plan  # QK-norms that exist are norms like the others and follow target
    kind = opts.qk_kind
    layers = _find(model)
    if kind is not None and not layers:
        report.notes.append(f"qk_norm={opts.qk_norm!r}: the model has no attention layers; no QK-norm added")
    for layer in layers:
        module, name = layer.module, layer.name
        if kind is not None and layer.note is not None and layer.note not in report.notes:
            report.notes.append(layer.note)
        if layer.reason is not None:
            if kind is not None:
                report.attention_skipped[name] = layer.reason
                plan.problems.append(f"{name} ({type(module).__qualname__}): {layer.reason}")
            continue
        attrs = layer.qk_attrs
        missing = list(attrs) if layer.changes_layer else [a for a in attrs if isinstance(getattr(module, a), nn.Identity)]
        for attr in (a for a in attrs if a not in missing):
            norm = getattr(module, attr)
            if norm_spec(norm) is None:  # not a norm the swap knows: no kind to give it
                if kind is not None:
                    report.attention_skipped[name] = f"its {attr} is a {type(norm).__qualname__}, not a known norm"
                continue
            plan.targets[id(norm)] = kind  # the body walk swaps it to this kind (None: leaves it)
            if kind is None:
                report.skipped[_child(name, attr)] = "QK-norm left alone (qk_norm=False)"
        if kind is None or not missing:
            continue
        if layer.head_dim is not None:
            head_dim = layer.head_dim
        else:  # a throwaway rebuild tells a torchvision layer's head width; apply() builds the real one
            head_dim = int((layer.replacement.from_module(module) if layer.replacement else module).head_dim)
        reason = deselected(module, [_child(name, a) for a in missing])
        user = reason is not None
        if reason is None and kind == "mrs" and head_dim % 2:
            reason = (f"odd head_dim {head_dim}: MRSNorm pairs adjacent channels; use an even head width, "
                      "qk_norm='rms'/'layer', or exclude this layer")
        if reason is None and layer.changes_layer and module is model:
            reason = "the model itself is this attention layer and cannot be replaced in place; wrap it"
        if reason is not None:
            report.attention_skipped[name] = reason
            if not user:
                plan.problems.append(f"{name} ({type(module).__qualname__}): {reason}")
            continue
        if layer.replacement is not None:
            plan.rebuilds[id(module)] = (module, layer.replacement)
            report.attention_replaced[name] = (type(module).__qualname__, layer.replacement.__qualname__)
        elif layer.attach is not None:
            plan.attachments.append((module, layer.attach))
            report.attention_replaced[name] = (type(module).__qualname__, layer.label or "hooked")
        for attr in missing:
            old = getattr(module, attr, None)
            if old is not None and (old._forward_hooks or old._forward_pre_hooks):
                report.notes.append(f"{_child(name, attr)}: hooks registered on the old Identity were not moved")
            norm = _new_norm(kind, module, head_dim, opts.eps)
            plan.additions.append((module, attr, norm))
            report.qk_added[_child(name, attr)] = f"{type(norm).__name__}({head_dim})"
    return plan
