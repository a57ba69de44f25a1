"""Issue 64's pre-registered rule (``recipes/sweeps/alternatives.py``) on synthetic ``results.csv`` files whose
answers are known by construction: each arm's best lr and values, the LR sensitivity by hand, the three verdicts."""

from __future__ import annotations

import csv

import pytest

from recipes.sweeps.alternatives import ARMS, arm_summary, main, verdicts

SEEDS = range(5)
NOISE = (-0.002, -0.001, 0.0, 0.001, 0.002)  # per seed: a small, known spread


def _rows(top1: dict[str, dict[float, float]]) -> list[dict[str, str]]:
    return [{"norm": arm, "lr": str(lr), "seed": str(s), "final_top1": str(mean + NOISE[s]), "diverged": "False"}
            for arm, curve in top1.items() for lr, mean in curve.items() for s in SEEDS]


def _write(tmp_path, rows: list[dict[str, str]]):
    path = tmp_path / "results.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


CURVES = {"layer": {0.1: 0.90, 1.0: 0.50}, "rms": {0.1: 0.89, 1.0: 0.60}, "mrs": {0.1: 0.80, 1.0: 0.945},
          "dyt": {0.1: 0.85, 1.0: 0.20}, "derf": {0.1: 0.95, 1.0: 0.30}}


def test_best_lr_values_and_sensitivity_by_hand() -> None:
    mrs = arm_summary(_rows(CURVES), "mrs", "final_top1")
    assert mrs.best_lr == 1.0 and mrs.best == pytest.approx([0.945 + n for n in NOISE])
    # each seed's gap to its own best, averaged over the 2 lrs: (0 + (0.945 - 0.80)) / 2
    assert mrs.sensitivity == pytest.approx([0.0725] * 5)


def test_the_three_verdicts(tmp_path, capsys) -> None:
    arms, (q1, q2, q3) = verdicts(_rows(CURVES), "final_top1")
    assert list(arms) == list(ARMS)
    assert q1.difference == pytest.approx(-0.05) and q1.verdict.startswith("no: DyT is worse")
    assert q2.difference == pytest.approx(0.10) and q2.verdict == "yes: Derf beats DyT"
    assert "derf" in q3.label and q3.difference == pytest.approx(-0.005)  # within the 1-point margin
    assert q3.verdict.startswith("within the margin of the best other (derf)")
    assert main([str(_write(tmp_path, _rows(CURVES)))]) == 0
    assert "**yes: Derf beats DyT**" in capsys.readouterr().out


def test_ties_matches_and_the_other_side() -> None:
    curves = {**CURVES, "dyt": {0.1: 0.899}, "derf": {0.1: 0.899}, "mrs": {0.1: 0.80}}
    _, (q1, q2, q3) = verdicts(_rows(curves), "final_top1")
    assert q1.verdict.startswith("yes: DyT matches") and q2.verdict == "no: a tie within the margin"
    assert q3.verdict.startswith("worse than the best other (layer) by more than the margin")


def test_language_models_lower_is_better_and_diverged_counts_8_bpb() -> None:
    rows = [{"norm": arm, "lr": "0.01", "seed": str(s), "final_bpb": str(bpb + NOISE[s]), "diverged": "False"}
            for arm, bpb in {"layer": 2.0, "rms": 2.1, "mrs": 1.9, "dyt": 2.2, "derf": 2.1}.items() for s in SEEDS]
    rows += [{"norm": "mrs", "lr": "1.0", "seed": str(s), "final_bpb": "nan", "diverged": "True"} for s in SEEDS]
    arms, (q1, q2, q3) = verdicts(rows, "final_bpb")
    assert arms["mrs"].best_lr == 0.01 and arms["mrs"].sensitivity == pytest.approx([(8 - 1.9 - n) / 2 for n in NOISE])
    assert q1.difference == pytest.approx(-0.2) and q1.verdict.startswith("no")  # lower bpb is better
    assert q2.verdict == "yes: Derf beats DyT" and q3.verdict.startswith("better than the best other (layer)")


def test_an_arm_with_too_few_seeds_is_an_error(tmp_path) -> None:
    rows = [r for r in _rows(CURVES) if not (r["norm"] == "derf" and r["seed"] == "4")]
    with pytest.raises(ValueError, match=r"arm 'derf': 4 seed\(s\) at its best lr; the rule needs"):
        verdicts(rows, "final_top1")
    with pytest.raises(SystemExit):
        main([str(_write(tmp_path, [r for r in rows if r["norm"] != "dyt"]))])
