"""The norm-swap engine: which layers are norms, what each becomes, and the swap itself.

================ =============================================================
``registry.py``  which modules are norm layers and their layout (``register_norm``)
``probe.py``     any other last-dim norm (a transformers ``*RMSNorm``...), recognised by running it
``hf.py``        the transformers norm classes whose formula is known (the probe must agree)
``layers.py``    layers the swap builds besides MRSNorm (LayerNorm2d, RMSNorm2d, OffsetRMSNorm, NormAct)
``dyt.py``       DyT/DyT2d, Dynamic Tanh: the norm-free baseline (``target="dyt"``)
``derf.py``      Derf/Derf2d, Dynamic erf: DyT with erf and a learnable shift (``target="derf"``)
``build.py``     one replacement from one old norm: the class and the weights
``options.py``   ``SwapOptions``, shared by ``swap_norms`` and the ``NormSwap`` callback
``report.py``    ``SwapReport``: what a swap did
``engine.py``    ``swap_norms``: plan every layer, then rewrite the model
``rewire.py``    point every reference to an old layer at its replacement
``layer_record.py`` one norm layer as data (a checkpoint's or config.json's record)
``spec.py``      a swapped model's norms as data (checkpoints), rebuilt on a fresh model
``hf_format.py`` a swapped transformers model saved as a custom model (``save_pretrained``)
================ =============================================================

Attention layers (QK-norms, ``qk_norm``): ``attention.py`` finds them and plans the QK-norms
(``iter_attention_layers``); ``attention_torchvision.py`` rebuilds torch/torchvision attention
with ``q_norm``/``k_norm`` (it imports torchvision's models, so it is loaded on first use);
``attention_hf.py`` finds how transformers attention computes q and k (loaded only for a
transformers model) and ``qk_hooks.py`` applies the QK-norms to the projections' outputs with hooks
(nothing copied); ``attention_info.py`` holds ``AttentionInfo``.
"""

from lightning_mrs.swap.attention import AttentionInfo, expose_attention, iter_attention_layers, register_attention
from lightning_mrs.swap.api import swap_norms
from lightning_mrs.swap.derf import Derf, Derf2d
from lightning_mrs.swap.dyt import DyT, DyT2d
from lightning_mrs.swap.layers import LayerNorm2d, NormAct, OffsetRMSNorm, RMSNorm2d
from lightning_mrs.swap.options import QK_NORMS, SWAP_TARGETS, Selector, SwapOptions
from lightning_mrs.swap.registry import NORM_KINDS, NormSpec, iter_norm_layers, norm_spec, register_norm
from lightning_mrs.swap.report import SwapReport

__all__ = [
    "Derf", "Derf2d", "DyT", "DyT2d", "LayerNorm2d", "NORM_KINDS", "NormAct", "NormSpec", "OffsetRMSNorm", "RMSNorm2d", "SWAP_TARGETS", "Selector",
    "SwapOptions", "SwapReport", "iter_norm_layers", "norm_spec", "register_norm", "swap_norms",
    "QK_NORMS", "AttentionInfo", "expose_attention", "iter_attention_layers", "register_attention",
]
