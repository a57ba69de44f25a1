"""The claims of the ``convert`` sweep and its healing table's lines, computed from ``results.csv`` and ``healing.csv``.

Every comparison is paired: an arm's value minus ``continue``'s (or ``mrs-calibrate``'s minus
``mrs-inherit``'s) of the same seed, lr and batch size (the same base model and data order), and the
per-seed differences go through Student's t interval (:func:`recipes.sweeps.claims.engine.single`).
**C** the control: the RMSNorm -> RMSNorm swap costs nothing (within :data:`MARGIN_BPB` either way,
right after the swap and after the healing); **S** swapping to MRSNorm is free at step 0 (the gap
below the margin), per init; **H** after the healing steps the converted model is within the margin
of the continued original, per init; **B0**/**BK** calibration beats inherit at step 0 / after the
healing. The margin is fixed before any sweep ran. Needs no torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Optional

from recipes.sweeps.claims.engine import Claim, Comparison, Values, single
from recipes.sweeps.claims.markdown import DECISION_RULE
from recipes.sweeps.claims.stats import MIN_SEEDS, mean_interval, mean_sd
from recipes.sweeps.records import Row, same_lr, select
from recipes.sweeps.score import BPB, DIVERGED_BPB

__all__ = ["ARMS", "CONTINUE", "MARGIN_BPB", "RULE", "TEXT", "claims", "first_within", "gaps", "healing_lines",
           "paired"]

CONTINUE = "continue"
ARMS = (CONTINUE, "mrs-inherit", "mrs-calibrate", "rms")
#: "within" / "costs nothing": at most this many bits per byte from the continued original
MARGIN_BPB = 0.02
_M = f"{MARGIN_BPB:g}"


def _step0(row: Row) -> Optional[float]:
    return row.metrics.get("bpb_step0")


def paired(rows: list[Row], arm: str, ref: str, lr: float, bs: int, get: Callable[[Row], Optional[float]]) -> Values:
    """The per-seed differences ``get(arm) - get(ref)`` over the seeds both have, and why they do not suffice."""
    for name in (arm, ref):
        if not any(r.arm == name for r in rows):
            return [], f"{name} was not in this sweep"
    a = {r.seed: get(r) for r in select(rows, lr=lr, batch_size=bs, arm=arm)}
    b = {r.seed: get(r) for r in select(rows, lr=lr, batch_size=bs, arm=ref)}
    where = f"{arm} and {ref} at lr {lr:g}, batch {bs}"
    both = sorted(set(a) & set(b))
    if not both:
        return [], f"missing cells: {where}"
    values = [a[s] - b[s] for s in both if a[s] is not None and b[s] is not None and math.isfinite(a[s] - b[s])]
    if len(both) < MIN_SEEDS:
        return values, f"too few seeds: {where} share n={len(both)} seed(s) (needs {MIN_SEEDS})"
    if len(values) < MIN_SEEDS:
        return values, f"too few usable values: {where}, {len(values)} of {len(both)} seeds"
    return values, None


def gaps(rows: list[Row], arm: str, get: Callable[[Row], Optional[float]]) -> list[tuple[int, float]]:
    """``(seed, get(arm) - get(continue))`` of every seed (any lr and batch size: the figure's), finite ones."""
    ref = {(r.lr, r.batch_size, r.seed): get(r) for r in rows if r.arm == CONTINUE}
    out = []
    for r in rows:
        value, base = (get(r), ref.get((r.lr, r.batch_size, r.seed))) if r.arm == arm else (None, None)
        if value is not None and base is not None and math.isfinite(value - base):
            out.append((r.seed, value - base))
    return out


def _combos(rows: list[Row]) -> list[tuple[float, int]]:
    out: list[tuple[float, int]] = []
    for r in sorted(rows, key=lambda r: (r.lr, r.batch_size)):
        if not any(same_lr(r.lr, lr) and r.batch_size == bs for lr, bs in out):
            out.append((r.lr, r.batch_size))
    return out


def _compare(rows: list[Row], arm: str, ref: str, get: Callable[[Row], Optional[float]], side: str,
             threshold: float, what: str) -> list[Comparison]:
    return [single(f"lr {lr:g}, batch {bs}: {what}", (f"{arm} - {ref}", paired(rows, arm, ref, lr, bs, get)), side,
                   threshold, "") for lr, bs in _combos(rows)]


_GAP0 = "the val bpb right after the swap (step 0) minus `continue`'s of the same seed"
_GAPK = (f"the final val bpb (after the healing steps; a diverged cell counts as {DIVERGED_BPB:g}) minus `continue`'s "
         "of the same seed")
TEXT: dict[str, tuple[str, str, str]] = {
    "C": ("The control: an RMSNorm -> RMSNorm swap costs nothing",
          "docs/swap.md: rms copies the weights; the Llama's RMSNorm and lightning-mrs's compute the same function, so "
          "the swap must not change the model (a check of the protocol, not of MRSNorm).",
          f"{_GAP0[0].upper()}{_GAP0[1:]}, and {_GAPK}, for `rms`: Student's t interval of the per-seed differences "
          f"inside (-{_M}, {_M}) bpb (each bound a comparison)."),
    "S-inherit": ("Swapping a trained model's RMSNorms for MRSNorm (init inherit) is free at step 0",
                  "docs/method.md: the swap keeps the trained weights (init=\"inherit\", a project choice); asked "
                  "because a user converting a trained model needs it (not stated by the paper).",
                  f"{_GAP0[0].upper()}{_GAP0[1:]}, for `mrs-inherit`: t interval below {_M} bpb."),
    "S-calibrate": ("Swapping to MRSNorm with calibrated weights is free at step 0",
                    "docs/swap.md (Calibrated conversion): init=\"calibrate\" fits the new weights on a batch so that "
                    "the trained model keeps what it computes.",
                    f"{_GAP0[0].upper()}{_GAP0[1:]}, for `mrs-calibrate`: t interval below {_M} bpb."),
    "H-inherit": ("After the healing steps the converted model (inherit) is back within the margin",
                  "Asked by issue 28: how fast a converted model heals with training (not stated by the paper).",
                  f"{_GAPK[0].upper()}{_GAPK[1:]}, for `mrs-inherit`: t interval below {_M} bpb. The steps it took "
                  "are in the Healing section."),
    "H-calibrate": ("After the healing steps the converted model (calibrate) is back within the margin",
                    "Asked by issue 28 (not stated by the paper).",
                    f"{_GAPK[0].upper()}{_GAPK[1:]}, for `mrs-calibrate`: t interval below {_M} bpb."),
    "B0": ("Calibration beats inherit right after the swap",
           "docs/swap.md (Calibrated conversion): the calibrated swap is closer to the trained model than inherit.",
           "The step-0 val bpb of `mrs-calibrate` minus `mrs-inherit`'s of the same seed: t interval below 0."),
    "BK": ("Calibration still beats inherit after the healing steps",
           "Asked by issue 28: whether calibration's head start lasts (not stated by the paper).",
           "The final val bpb of `mrs-calibrate` minus `mrs-inherit`'s of the same seed: t interval below 0."),
}

RULE = (
    "Computed by `recipes/sweeps/claims/convert.py` from `results.csv`; nothing in this section is written by hand.",
    "",
    *DECISION_RULE,
    f"**Paired over seeds.** Every comparison is a per-seed difference between two arms of the same seed (the same "
    f"base model, calibration batch and healing data order), so its interval is Student's t interval of those "
    f"differences. **Margin**: {_M} bpb, fixed before any sweep ran; \"free\" and \"within\" mean a gap below it.",
    "",
)


def claims(rows: list[Row]) -> list[Claim]:
    """The ``convert`` sweep's claims over typed ``results.csv`` rows, not yet evaluated."""
    rms0, rmsk = "rms - continue at step 0", "rms - continue after the healing"
    groups = {
        "C": [(rms0, _compare(rows, "rms", CONTINUE, _step0, "below", MARGIN_BPB, f"below {_M}")
               + _compare(rows, "rms", CONTINUE, _step0, "above", -MARGIN_BPB, f"above -{_M}")),
              (rmsk, _compare(rows, "rms", CONTINUE, BPB.counted, "below", MARGIN_BPB, f"below {_M}")
               + _compare(rows, "rms", CONTINUE, BPB.counted, "above", -MARGIN_BPB, f"above -{_M}"))],
        "B0": [("mrs-calibrate - mrs-inherit at step 0",
                _compare(rows, "mrs-calibrate", "mrs-inherit", _step0, "below", 0.0, "below 0"))],
        "BK": [("mrs-calibrate - mrs-inherit after the healing",
                _compare(rows, "mrs-calibrate", "mrs-inherit", BPB.counted, "below", 0.0, "below 0"))],
    }
    for init in ("inherit", "calibrate"):
        arm = f"mrs-{init}"
        groups[f"S-{init}"] = [(f"{arm} - continue at step 0",
                                _compare(rows, arm, CONTINUE, _step0, "below", MARGIN_BPB, f"below {_M}"))]
        groups[f"H-{init}"] = [(f"{arm} - continue after the healing",
                                _compare(rows, arm, CONTINUE, BPB.counted, "below", MARGIN_BPB, f"below {_M}"))]
    return [Claim(key, *TEXT[key], groups=groups[key]) for key in TEXT]


# ----------------------------------------------------------------------------- the healing table's lines
def first_within(curve: dict[int, float], margin: float = MARGIN_BPB) -> Optional[int]:
    """The first step of ``curve`` (step -> gap) whose gap is at most ``margin``; ``None``: never.

    Example:
        >>> first_within({0: 0.3, 10: 0.05, 20: 0.01, 40: 0.03})
        20
    """
    return next((step for step, gap in sorted(curve.items()) if gap <= margin), None)


def _cell(values: list[float]) -> str:
    mean, sd, n = mean_sd(values)
    if n == 0:
        return "-"
    return f"{mean:+.3f} ± {sd:.3f}" if n > 1 else f"{mean:+.3f}"


def healing_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per lr and batch size, a table of the mean gap to ``continue`` (± sd over seeds) at every evaluated step,
    the first step within the margin per seed and the first step whose 95 % interval lies below it."""
    curves: dict[tuple, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("val_bpb") is not None and r.get("step") is not None:
            key = (float(r["lr"]), int(r["batch_size"]), str(r["arm"]))
            curves[key][int(r["seed"])][int(r["step"])] = float(r["val_bpb"])
    lines: list[str] = []
    for lr, bs in sorted({(lr, bs) for lr, bs, _ in curves}):
        ref = curves.get((lr, bs, CONTINUE))
        if not ref:
            lines += [f"lr {lr:g}, batch {bs}: no `continue` cells, so no gaps.", ""]
            continue
        steps = sorted({s for by_step in ref.values() for s in by_step})
        arms = [a for a in ARMS if a != CONTINUE and (lr, bs, a) in curves]
        arms += sorted(a for (l2, b2, a) in curves if (l2, b2) == (lr, bs) and a not in ARMS)
        base = [ref[seed][0] for seed in sorted(ref) if 0 in ref[seed]]
        lines += [f"lr {lr:g}, batch {bs}: gap to `continue` (bpb, mean ± sd over seeds; `continue` itself at step 0: "
                  f"{_cell(base).lstrip('+')} bpb, at step {steps[-1]}: "
                  f"{_cell([ref[s][steps[-1]] for s in ref if steps[-1] in ref[s]]).lstrip('+')} bpb)", "",
                  "| arm | " + " | ".join(f"step {s}" for s in steps) + " | first within (per seed) | 95 % within from |",
                  "|:---|" + "---:|" * len(steps) + ":---|:---|"]
        for arm in arms:
            per_seed = {seed: {s: v - ref[seed][s] for s, v in by_step.items() if s in ref.get(seed, {})}
                        for seed, by_step in curves[(lr, bs, arm)].items() if seed in ref}
            cells, interval_from = [], None
            for s in steps:
                values = [g[s] for g in per_seed.values() if s in g and math.isfinite(g[s])]
                cells.append(_cell(values))
                if interval_from is None and len(values) >= MIN_SEEDS and mean_interval(values).high < MARGIN_BPB:
                    interval_from = s
            firsts = ", ".join(f"seed {seed}: " + (str(f) if (f := first_within(g)) is not None else
                                                   f"not within {steps[-1]}") for seed, g in sorted(per_seed.items()))
            within = (f"step {interval_from}" if interval_from is not None else
                      f"not by step {steps[-1]}" if len(per_seed) >= MIN_SEEDS else f"needs {MIN_SEEDS} seeds")
            lines.append(f"| {arm} | " + " | ".join(cells) + f" | {firsts} | {within} |")
        lines.append("")
    return lines
