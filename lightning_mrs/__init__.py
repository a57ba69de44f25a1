"""lightning-mrs core: MRSNorm (Mean Root Square / phasor normalisation) for PyTorch.

Needs only torch. The Lightning callbacks live in the separate ``callbacks`` package.
"""

from lightning_mrs.functional import mrs_norm, mrs_scale
from lightning_mrs.modules import MRSNorm, MRSNorm2d
from lightning_mrs.norm_registry import NormSpec, iter_norm_layers, norm_spec, register_norm
from lightning_mrs.stats import aggregate_stats, layer_stats, phasor_sums, weight_grad_stats
from lightning_mrs.swap import SWAP_TARGETS, SwapReport, swap_norms
from lightning_mrs.swap_layers import LayerNorm2d, NormAct, RMSNorm2d
from lightning_mrs.synthetic import SyntheticCIFAR100

__all__ = [
    "MRSNorm", "MRSNorm2d", "mrs_norm", "mrs_scale",
    "NormSpec", "norm_spec", "iter_norm_layers", "register_norm", "LayerNorm2d", "RMSNorm2d", "NormAct",
    "swap_norms", "SwapReport", "SWAP_TARGETS",
    "phasor_sums", "layer_stats", "aggregate_stats", "weight_grad_stats",
    "SyntheticCIFAR100",
]
__version__ = "0.1.0"
