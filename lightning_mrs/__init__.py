"""lightning-mrs core: MRSNorm (Mean Root Square / phasor normalisation) for PyTorch.

Needs only torch. The Lightning callbacks live in the separate ``callbacks`` package.
"""

from lightning_mrs.functional import mrs_norm, mrs_scale
from lightning_mrs.modules import MRSNorm, MRSNorm2d

__all__ = ["MRSNorm", "MRSNorm2d", "mrs_norm", "mrs_scale"]
__version__ = "0.1.0"
