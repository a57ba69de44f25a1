"""lightning-mrs core: MRSNorm (Mean Root Square / phasor normalisation) for PyTorch.

Needs only torch: the op (:mod:`lightning_mrs.ops`), the modules, the norm-swap engine
(:mod:`lightning_mrs.swap`), the per-phasor statistics (:mod:`lightning_mrs.stats`) and the
attention statistics (:mod:`lightning_mrs.attention_stats`).
The Lightning callbacks live in :mod:`lightning_mrs.callbacks` (imported on demand only).
"""

from lightning_mrs.attention_stats import AttentionSums, attention_figures, attention_sums, query_sample
from lightning_mrs.modules import MRSNorm, MRSNorm2d
from lightning_mrs.ops import mrs_norm, mrs_scale
from lightning_mrs.pretrained import from_pretrained
from lightning_mrs.stats import aggregate_stats, layer_stats, phasor_sums, weight_grad_stats
from lightning_mrs.swap import (
    QK_NORMS,
    SWAP_TARGETS,
    AttentionInfo,
    Derf,
    Derf2d,
    DyT,
    DyT2d,
    LayerNorm2d,
    NormAct,
    NormSpec,
    OffsetRMSNorm,
    RMSNorm2d,
    SwapOptions,
    SwapReport,
    expose_attention,
    iter_attention_layers,
    iter_norm_layers,
    norm_spec,
    register_norm,
    swap_norms,
)
from lightning_mrs.swap.hf_format import transformers_class
from lightning_mrs.version import __version__

__all__ = [
    "MRSNorm", "MRSNorm2d", "mrs_norm", "mrs_scale",
    "NormSpec", "norm_spec", "iter_norm_layers", "register_norm", "LayerNorm2d", "RMSNorm2d", "OffsetRMSNorm", "NormAct",
    "DyT", "DyT2d", "Derf", "Derf2d",
    "swap_norms", "SwapOptions", "SwapReport", "SWAP_TARGETS", "from_pretrained", "transformers_class",
    "QK_NORMS", "AttentionInfo", "iter_attention_layers", "expose_attention",
    "phasor_sums", "layer_stats", "aggregate_stats", "weight_grad_stats",
    "AttentionSums", "attention_sums", "attention_figures", "query_sample",
]
