"""The sweep kinds ``--sweep`` knows, by name; the first is the default.

A new kind: a module defining its :class:`~recipes.sweeps.kind.Sweep`, and one line here.
"""

from __future__ import annotations

from recipes.sweeps.kinds.convert import CONVERT
from recipes.sweeps.kind import Sweep
from recipes.sweeps.kinds.lm import LM
from recipes.sweeps.kinds.lm_qk import LM_QK
from recipes.sweeps.kinds.norm import NORM
from recipes.sweeps.kinds.norm_vit import NORM_VIT
from recipes.sweeps.kinds.qk import QK

__all__ = ["DEFAULT", "SWEEPS"]

SWEEPS: dict[str, Sweep] = {kind.name: kind for kind in (
    NORM,
    QK,
    NORM_VIT,
    LM,
    LM_QK,
    CONVERT,
)}
#: the kind ``--sweep`` defaults to
DEFAULT = NORM.name
