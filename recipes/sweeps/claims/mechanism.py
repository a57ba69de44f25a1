"""The ``lm`` sweep's mechanism stress: the paper's float16 failure without training in float16.

Training in pure float16 fails for reasons that have nothing to do with a norm (AdamW's ``eps``
rounds to 0 in float16), so the mechanism is measured on trained models instead: every fp32 cell of
the sweep at :data:`MECHANISM_LR` (RMSNorm and MRSNorm models) is evaluated afterwards in pure float16
(the model cast to float16, :mod:`recipes.sweeps.cells.mechanism_eval`) with one residual-stream channel
(:data:`CHANNEL`) set to a magnitude ``m`` of :data:`MAGNITUDES` (2^4 ... 2^15; 0: nothing planted) in
every token at the input of every norm, four ways:

* ``rms``, ``mrs``: the trained model as it is (both norms compute in float32 inside);
* ``rms-half``, ``mrs-half``: the same weights, the norms swapped to the half-precision baselines of
  :mod:`lightning_mrs.swap.half` that form the squares in float16 (each formula as it reads);
* ``rms-half-safe``, ``mrs-half-safe``: the same, computed without intermediate overflow (RMSNorm
  scaled by ``max|x|`` before squaring; MRSNorm's magnitudes by ``hypot``).

Per (model, arm, ``m``): the validation bits per byte on the sweep's validation windows and the share
of norm outputs (tokens, over every norm call) that are non-finite or all zero. The arithmetic says
both naive arms break where ``m^2`` passes float16's 65504 (``m >= 256``), whichever the formula, and
the safe arms only where a result itself leaves float16 (beyond the planted range). Claim **M** tests
that, from ``mechanism.csv`` alone (rows written before the safe arms existed named the ``hypot``
MRSNorm ``mrs-half``: :data:`LEGACY_ARMS`). Needs no torch.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Callable, Optional

from recipes.sweeps import figure as fig
from recipes.sweeps.claims.engine import Claim, Comparison, Values, single
from recipes.sweeps.claims.stats import MIN_SEEDS
from recipes.sweeps.kind import Table
from recipes.sweeps.records import same_lr
from recipes.sweeps.score import DIVERGED_BPB

__all__ = ["ARMS", "BROKEN_SHARE", "LEGACY_ARMS", "NAIVE", "SAFE", "CHANNEL", "CLEAN_SHARE", "COLUMNS", "FP16_MAX", "MAGNITUDES", "MARGIN_BPB",
           "MECHANISM", "MECHANISM_LR", "SQUARE_LIMIT", "claims", "figure", "source"]

#: the lr of the fp32 models the mechanism stress evaluates (the sweep's fp32 arms also run there)
MECHANISM_LR = 0.01
#: the planted magnitudes: 2^4 .. 2^15 (2^16 is past float16's largest finite value)
MAGNITUDES = tuple(2.0**k for k in range(4, 16))
#: the residual-stream channel set to the planted magnitude (channel 0: the first of phasor 0)
CHANNEL = 0
#: float16's largest finite value, and the |x| from which x^2 rounds to Inf there
FP16_MAX, SQUARE_LIMIT = 65504.0, 256.0
#: the arms evaluated, and the trained norm each one takes its weights from
ARMS = {"rms": "rms", "mrs": "mrs", "rms-half": "rms", "mrs-half": "mrs", "rms-half-safe": "rms",
        "mrs-half-safe": "mrs"}
#: the half-precision arms that form x^2 in float16, and those computed without intermediate overflow
NAIVE, SAFE = ("rms-half", "mrs-half"), ("rms-half-safe", "mrs-half-safe")
#: a mechanism.csv written before the safe arms (no ``*-safe`` row) named today's ``mrs-half-safe`` (hypot)
#: ``mrs-half``: :func:`legacy` renames it when a table is read
LEGACY_ARMS = {"mrs-half": "mrs-half-safe"}
#: "broken": more than half of the norm outputs non-finite or all zero; "clean": under 1 %
BROKEN_SHARE, CLEAN_SHARE = 0.5, 0.01
#: "costs nothing" (bpb): the half-internal MRSNorm at most this far above MRSNorm (the lm sweep's P5 margin)
MARGIN_BPB = 0.03
COLUMNS = ("norm", "arm", "lr", "batch_size", "seed", "magnitude", "val_bpb", "bad_frac", "nonfinite_frac",
           "zero_frac", "norm_tokens")
_NUMERIC = ("lr", "batch_size", "seed", "magnitude", "val_bpb", "bad_frac", "nonfinite_frac", "zero_frac",
            "norm_tokens")


def legacy(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with the arms of a table written before the safe arms existed renamed (:data:`LEGACY_ARMS`).

    Such a table has no ``*-safe`` arm; its ``mrs-half`` was MRSNorm by ``hypot``, today's ``mrs-half-safe``."""
    if any(str(r.get("arm", "")).endswith("-safe") for r in rows):
        return rows
    return [dict(r, arm=LEGACY_ARMS.get(r.get("arm"), r.get("arm"))) for r in rows]


def source(arm: str) -> str:
    """The trained norm an evaluated arm takes its weights from (``mrs-half`` -> ``mrs``)."""
    return ARMS[arm]


def _bpb(row: dict[str, Any]) -> float:
    """A NaN or Inf bpb (the logits were not finite) counts as a uniform guess, as a diverged cell does."""
    value = row.get("val_bpb")
    return min(value, DIVERGED_BPB) if value is not None and math.isfinite(value) else DIVERGED_BPB


Get = Callable[[dict[str, dict[float, dict[str, Any]]]], Optional[float]]  # a seed's rows by arm and m -> value


def _per_seed(rows: list[dict[str, Any]], bs: float, get: Get, arms: tuple[str, ...]) -> Values:
    """Per seed of the fp32 models at MECHANISM_LR and batch ``bs``, ``get`` of its rows; why they do not suffice."""
    mine = [r for r in rows if same_lr(r["lr"], MECHANISM_LR) and r["batch_size"] == bs]
    if not mine:
        return [], f"missing cells: no fp32 model at lr {MECHANISM_LR:g}, batch {bs:g} (none evaluated)"
    values = []
    for seed in sorted({r["seed"] for r in mine}):
        by: dict[str, dict[float, dict[str, Any]]] = {}
        for r in mine:
            if r["seed"] == seed:
                by.setdefault(r["arm"], {})[r["magnitude"]] = r
        if not all(a in by and all(m in by[a] for m in MAGNITUDES) for a in arms):
            continue
        value = get(by)
        if value is not None and math.isfinite(value):
            values.append(value)
    if len(values) < MIN_SEEDS:
        return values, f"too few seeds: {len(values)} with every magnitude of {' '.join(arms)} (needs {MIN_SEEDS})"
    return values, None


def _extreme(arm: str, pick: Callable[..., float], where: Callable[[float], bool], key: str = "bad_frac") -> Get:
    return lambda by: pick(by[arm][m][key] for m in MAGNITUDES if where(m))


def _cost(a: str, b: str, pick: Callable[..., float], where: Callable[[float], bool]) -> Get:
    return lambda by: pick(_bpb(by[a][m]) - _bpb(by[b][m]) for m in MAGNITUDES if where(m))


TEXT = ("Mechanism: a norm that forms x^2 in float16 breaks where x^2 overflows (|x| >= 256), RMSNorm and MRSNorm "
        "alike; computed without intermediate overflow neither breaks, and no shipped norm does",
        "Abstract: in RMSNorm, sum(x^2) lets a single large-magnitude channel dominate the denominator, which in mixed "
        "precision leads to numerical explosion; MRSNorm takes each phasor's magnitude first.",
        f"The mechanism stress (section below): the fp32 models at lr {MECHANISM_LR:g} evaluated in pure float16 with "
        f"channel {CHANNEL} of every norm input set to m = 2^4 .. 2^15. Per seed: for the naive `rms-half` and "
        f"`mrs-half` (squares formed in float16), the smallest share of non-finite or all-zero norm outputs over "
        f"m >= {SQUARE_LIMIT:g}, t interval above {BROKEN_SHARE:g}, and the largest over m < {SQUARE_LIMIT:g}, below "
        f"{CLEAN_SHARE:g}; for `rms-half-safe`, `mrs-half-safe` (no intermediate overflow), `rms` and `mrs` (float32 "
        f"inside), the largest over every m, below {CLEAN_SHARE:g}. The cost in bpb (a NaN counted as "
        f"{DIVERGED_BPB:g}): the smallest over m >= {SQUARE_LIMIT:g} of each naive arm minus its shipped norm (same "
        f"weights), above 0; the largest over every m of each safe arm minus its shipped norm, below {MARGIN_BPB:g} "
        "bpb.")

RULE = (
    f"**Mechanism stress** (claim M): the thresholds `BROKEN_SHARE` = {BROKEN_SHARE:g}, `CLEAN_SHARE` = "
    f"{CLEAN_SHARE:g} and `MARGIN_BPB` = {MARGIN_BPB:g} are constants of "
    "`recipes/sweeps/claims/mechanism.py` fixed before "
    "it ran; per seed, the extreme over the planted magnitudes makes each comparison hold at every magnitude.",
    "",
)


def claims(rows: list[dict[str, Any]]) -> list[Claim]:
    """Claim M over ``mechanism.csv``'s rows (:func:`legacy` names), not yet evaluated."""
    rows = legacy(rows)
    sizes = sorted({r["batch_size"] for r in rows}) or [16.0]
    broken, clean, cost = [], [], []
    high, low, every = (lambda m: m >= SQUARE_LIMIT), (lambda m: m < SQUARE_LIMIT), (lambda m: True)
    for bs in sizes:
        at = f"batch {bs:g}: "
        for arm in NAIVE:
            broken.append(single(f"{at}{arm}, smallest share over m >= {SQUARE_LIMIT:g}",
                                 (arm, _per_seed(rows, bs, _extreme(arm, min, high), (arm,))), "above", BROKEN_SHARE,
                                 ""))
            clean.append(single(f"{at}{arm}, largest share over m < {SQUARE_LIMIT:g}",
                                (arm, _per_seed(rows, bs, _extreme(arm, max, low), (arm,))), "below", CLEAN_SHARE, ""))
        for arm in (*SAFE, "rms", "mrs"):
            values = _per_seed(rows, bs, _extreme(arm, max, every), (arm,))
            clean.append(single(f"{at}{arm}, largest share over every m", (arm, values), "below", CLEAN_SHARE, ""))
        for arm in NAIVE:
            base = source(arm)
            cost.append(single(f"{at}{arm} - {base}, smallest over m >= {SQUARE_LIMIT:g}",
                               (f"{arm} - {base}", _per_seed(rows, bs, _cost(arm, base, min, high), (arm, base))),
                               "above", 0.0, ""))
        for arm in SAFE:
            base = source(arm)
            cost.append(single(f"{at}{arm} - {base}, largest over every m",
                               (f"{arm} - {base}", _per_seed(rows, bs, _cost(arm, base, max, every), (arm, base))),
                               "below", MARGIN_BPB, ""))
    groups: list[tuple[str, list[Comparison]]] = [
        (f"rms-half and mrs-half break where the square overflows: share of non-finite or all-zero norm outputs "
         f"above {BROKEN_SHARE:g}", broken),
        (f"and nothing else breaks: that share below {CLEAN_SHARE:g}", clean),
        ("what it costs: val bpb against the same weights computed in float32 inside", cost),
    ]
    return [Claim("M", *TEXT, groups=groups)]


_X_UNPLANTED = 2.0**2  # where the unplanted (m = 0) point is drawn on the log2 axis


def figure(rows: list[dict[str, Any]], path: Path) -> Any:
    """The share of broken norm outputs (left) and the val bpb (right) against the planted magnitude, one line
    per arm (mean over the seeds at MECHANISM_LR, band = min-max); returns the two panels."""
    plt = fig.pyplot()
    rows = legacy(rows)
    mine = [r for r in rows if same_lr(r["lr"], MECHANISM_LR)] or rows
    seeds = sorted({r["seed"] for r in mine})
    figure_, (bad, bpb) = plt.subplots(1, 2, figsize=(10.0, 4.2), constrained_layout=True)
    styles = {"rms": ("tab:orange", "-"), "mrs": ("tab:green", "-"), "rms-half": ("tab:orange", "--"),
              "mrs-half": ("tab:green", "--"), "rms-half-safe": ("tab:red", ":"), "mrs-half-safe": ("tab:blue", ":")}
    for arm, (colour, style) in styles.items():
        for ax, value in ((bad, lambda r: r["bad_frac"]), (bpb, _bpb)):
            xs, mean, low, high = [], [], [], []
            for m in (0.0, *MAGNITUDES):
                vs = [value(r) for r in mine if r["arm"] == arm and r["magnitude"] == m]
                vs = [v for v in vs if v is not None and math.isfinite(v)]
                if vs:
                    xs.append(m or _X_UNPLANTED)
                    mean.append(statistics.fmean(vs))
                    low.append(min(vs))
                    high.append(max(vs))
            ax.plot(xs, mean, style, marker="o", ms=3.5, color=colour, lw=1.6, label=arm)
            ax.fill_between(xs, low, high, color=colour, alpha=0.15, lw=0)
    ticks = [_X_UNPLANTED, *MAGNITUDES[::2]]
    for ax in (bad, bpb):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, ["none", *(f"$2^{{{int(math.log2(m))}}}$" for m in MAGNITUDES[::2])], fontsize=8)
        ax.minorticks_off()
        ax.axvline(SQUARE_LIMIT, color="k", ls=":", lw=1)
        ax.text(SQUARE_LIMIT, 0.98, " x$^2$ > 65504", transform=ax.get_xaxis_transform(), fontsize=8, va="top")
        ax.set_xlabel(f"magnitude planted in channel {CHANNEL} before every norm")
        ax.grid(alpha=0.3)
    bad.set_ylim(-0.03, 1.03)
    bad.set_ylabel("share of norm outputs non-finite or all zero")
    bpb.axhline(DIVERGED_BPB, color="k", ls=":", lw=1)
    bpb.set_ylabel(f"val bits per byte in pure float16 (NaN = {DIVERGED_BPB:g})")
    handles, labels = bad.get_legend_handles_labels()
    fig.save(plt, figure_, handles, labels, f"Mechanism stress: fp32 models (lr {MECHANISM_LR:g}) evaluated in pure "
             f"float16, one channel planted; mean over {len(seeds)} seed(s), band = min-max; dashed: the norms "
             "computed in float16 (squares formed), dotted: in float16 without overflow", path, diverged=False)
    return bad, bpb


def lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per planted magnitude and arm, mean over the seeds at MECHANISM_LR: the share of broken norm outputs and
    the val bpb (a NaN counted as 8)."""
    mine = [r for r in legacy(rows) if same_lr(r["lr"], MECHANISM_LR)]
    if not mine:
        return []
    arms = [a for a in ARMS if any(r["arm"] == a for r in mine)]
    out = [f"Mean over {len({r['seed'] for r in mine})} seed(s) (lr {MECHANISM_LR:g}): share of norm outputs "
           "non-finite or all zero / val bpb.", "",
           "| planted m | " + " | ".join(arms) + " |", "|---:|" + "---:|" * len(arms)]
    for m in (0.0, *MAGNITUDES):
        cells = []
        for arm in arms:
            got = [r for r in mine if r["arm"] == arm and r["magnitude"] == m]
            cells.append(f"{statistics.fmean(r['bad_frac'] for r in got):.3g} / "
                         f"{statistics.fmean(_bpb(r) for r in got):.3f}" if got else "-")
        out.append(f"| {'none' if not m else f'{m:g}'} | " + " | ".join(cells) + " |")
    return out + [""]


MECHANISM = Table(
    name="mechanism", columns=COLUMNS, numeric=_NUMERIC, title="Mechanism stress (pure float16, a planted channel)",
    intro=(
        f"The fp32 models of the sweep at lr {MECHANISM_LR:g} (`rms-fp32`, `mrs-fp32`), evaluated after training in "
        f"pure float16 (the model cast to float16, as `16-true`) on the validation windows, with channel {CHANNEL} of "
        "the residual stream set to m in every token at the input of every norm (a forward pre-hook: the residual "
        "stream itself is not changed), m = 0 (nothing planted) and 2^4 .. 2^15. Arms: `rms` and `mrs`, the trained "
        "norms (they compute in float32 inside); `rms-half` and `mrs-half`, the same weights with the norms swapped "
        "to the half-precision baselines that form the squares in float16 (`lightning_mrs/swap/half.py`: each "
        "formula as it reads, every step in float16); `rms-half-safe` and `mrs-half-safe`, the same computed in "
        "float16 without intermediate overflow (RMSNorm scaled by max|x| before squaring, as BLAS nrm2; MRSNorm's "
        "magnitudes by `hypot`). Per row: `val_bpb` (NaN when the logits were not finite), "
        "`bad_frac` = the share of norm output tokens (every norm call) that are non-finite or all zero "
        "(`nonfinite_frac`, `zero_frac` apart).",
    ),
    claims=claims, rule=RULE, figure=figure,
    plotted="that share and the val bpb against the planted magnitude, per arm", lines=lines,
)
