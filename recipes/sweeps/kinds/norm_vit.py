"""The ``norm-vit`` sweep: the body norms of the digits ViT, issue 64's comparison of MRSNorm with the norm-free DyT
and Derf where those were made (transformers).

Arms: ``layer`` (the ViT's own LayerNorm, as swapped), ``rms``, ``mrs``, ``dyt``, ``derf`` (every norm layer of the
model replaced, the old affine weights carried over) x learning rate x seed, on the QK sweep's digits ViT
(:data:`recipes.sweeps.kinds.qk.VIT_DIGITS`) with its AdamW, grid of lrs and batch size. Everything a cell measures
is the ``norm`` sweep's (:mod:`recipes.sweeps.kinds.norm`). Its comparison is issue 64's pre-registered rule
(``docs/results.md``, "Norm-free alternatives"), applied to ``results.csv`` by :mod:`recipes.sweeps.alternatives`;
the report's claims section states that rule rather than the ResNet paper's claims. Needs no torch.
"""

from __future__ import annotations

import dataclasses

from recipes.sweeps.alternatives import ARMS, MIN_SEEDS
from recipes.sweeps.claims.engine import Claim
from recipes.sweeps.kinds.norm import NORM
from recipes.sweeps.kinds.qk import QK
from recipes.sweeps.records import Row

__all__ = ["NORM_VIT", "RULE"]

RULE = ("The comparison of these arms is issue 64's rule, fixed before any cell ran: `docs/results.md`, \"Norm-free "
        "alternatives (issue 64): the rule, fixed before the run\". Its verdicts are computed from this folder's "
        "`results.csv` by `python -m recipes.sweeps.alternatives results.csv`; the sections above (per-cell table, "
        "learning-rate robustness) are this sweep's own.", "")


def claims(rows: list[Row]) -> list[Claim]:
    """None here: the three questions are :mod:`recipes.sweeps.alternatives`' (see :data:`RULE`)."""
    return []


NORM_VIT = dataclasses.replace(
    NORM, name="norm-vit", flag="--vit-norms", arms=ARMS,
    arms_help="--sweep norm-vit: body norms of the digits ViT (layer: its own LayerNorm)",
    grid={"arms": list(ARMS), "lrs": QK.grid["lrs"], "batch_sizes": QK.grid["batch_sizes"],
          "seeds": list(range(MIN_SEEDS))},
    quick={"lrs": [0.003, 0.03], "seeds": [0], "epochs": {"digits": 2}},
    datasets={name: QK.datasets[name] for name in ("digits", "folder")}, default_dataset="digits",
    optimizer=QK.optimizer, weight_decay=QK.weight_decay, warmup_frac=QK.warmup_frac, optimizer_text=QK.optimizer_text,
    help="norm-vit: the body norms of the digits ViT, with DyT and Derf",
    claims=claims, rule=RULE, title="ViT norm sweep: MRSNorm, LayerNorm, RMSNorm, DyT, Derf",
    cell_prefix="normvit-", out_stem="stress_norm_vit",
)
