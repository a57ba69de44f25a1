"""The language-model recipe's check that a requested norm swap did what was asked.

``swap_norms`` skips what it cannot convert and says so in its report; a recipe run that asked
for ``--model.norm mrs`` and trained the model's own norms instead would report a comparison
that never happened. :func:`check_swap` turns "nothing converted" into a usage error.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from lightning_mrs.swap import SwapReport, iter_attention_layers
from lightning_mrs.swap.attention_info import is_qk_name
from lightning_mrs.swap.probe import looks_like_norm
from recipes.common.errors import UsageError
from recipes.common.training import check_qk_norms

__all__ = ["check_swap", "norm_like"]


def norm_like(model: nn.Module) -> Counter:
    """Class name -> count of the modules named like a norm (the swap's and monitors' rule,
    :func:`lightning_mrs.swap.probe.looks_like_norm`)."""
    return Counter(type(m).__name__ for m in model.modules() if looks_like_norm(m))


def check_swap(model: nn.Module, arch: str, norm: str, qk_norm: str, report: SwapReport) -> None:
    """Raise a usage error when ``--model.norm``/``--model.qk_norm`` converted nothing.

    A body swap must have converted (or found already of the target kind) at least one norm
    that is not a QK-norm; a QK-norm request must have put one in every attention layer the
    swap engine knows (or, when it knows none of the model's, at least one).
    """

    if norm != "none" and not [n for n in report.converted + report.unchanged if not is_qk_name(n)]:
        found = ", ".join(f"{name} x{count}" for name, count in sorted(norm_like(model).items())) or "none found"
        why = next(iter(report.skipped.values()), None) or next(iter(report.notes), "no norm layer it knows")
        raise UsageError(f"--model.norm {norm}: swap_norms converted none of the {arch} model's norm layers "
                         f"({found}; {why}); use --model.norm none to train the model's own norms.")
    if qk_norm == "none":
        return
    if next(iter_attention_layers(model), None) is not None:
        check_qk_norms(model, qk_norm, report, arch)
        return
    if not report.qk_added and not [n for n in report.converted + report.unchanged if is_qk_name(n)]:
        why = "; ".join(report.notes) or "no attention layer it knows"
        raise UsageError(f"--model.qk_norm {qk_norm}: swap_norms added no QK-norm to the {arch} model ({why}); "
                         "use --model.qk_norm none.")
