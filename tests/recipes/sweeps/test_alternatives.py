"""Issue 64's pre-registered rule (``recipes/sweeps/alternatives.py``) on synthetic ``results.csv`` files whose
answers are known by construction: each arm's best lr and values, the LR sensitivity by hand, the three verdicts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from recipes.sweeps.alternatives import ARMS, COMPARISONS, arm_summary, held_out, main, report, verdicts

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


def test_held_out_seeds_agree_or_not_in_direction() -> None:
    arms, _ = verdicts(_rows(CURVES), "final_top1")  # best lrs: mrs 1.0, every other arm 0.1
    held = {"layer": 0.80, "rms": 0.70, "mrs": 0.90, "dyt": 0.85, "derf": 0.95}

    def rows(layer: float) -> list[dict[str, str]]:
        out = [{"norm": arm, "lr": "1.0" if arm == "mrs" else "0.1", "seed": str(s),
                "final_top1": str(layer if arm == "layer" else v), "diverged": "False"}
               for arm, v in held.items() for s in (5, 6, 7)]
        return out + [{"norm": "dyt", "lr": "1.0", "seed": "5", "final_top1": "0.0", "diverged": "False"}]  # not its best

    got = [(label, round(m, 6), round(h, 6), same) for label, m, h, same in held_out(arms, rows(0.80), "final_top1")]
    assert got == [("DyT - LayerNorm", -0.05, 0.05, False), ("Derf - DyT", 0.1, 0.1, True),
                   ("MRSNorm - derf", -0.005, -0.05, True)]
    assert [same for *_, same in held_out(arms, rows(0.95), "final_top1")] == [True, True, True]


def _stem(tmp_path, curves=CURVES):
    stem = tmp_path / "alt"
    for name, _, metric, precision in COMPARISONS:
        rows = _rows(curves) if metric == "final_top1" else [
            {**r, "final_bpb": str(3 - float(r.pop("final_top1"))), "precision": "bf16-mixed"} for r in _rows(curves)]
        rows += [{**r, "norm": "batch"} for r in rows if r["norm"] == "layer"] if name == "resnet" else []
        for r in rows:
            r["cpu_s"] = "6"
        _write(tmp_path, rows).rename(tmp_path / f"alt_{name}.csv")
    held = [r for r in _rows(curves) if float(r["lr"]) == (1.0 if r["norm"] == "mrs" else 0.1)]  # the best lrs
    for r in held:
        r.update(seed=str(int(r["seed"]) + 5), cpu_s="6")
    _write(tmp_path, held).rename(tmp_path / "alt_vit_heldout.csv")
    facts = {"rule_commit": "abc1234", "rule_time": "2026-12-07 11:47 UTC", "cells_started": "2026-12-07 13:58 UTC",
             "budget": "nothing cut.", "commands": {name: f"python recipes/stress.py --sweep {name}" for name, *_ in COMPARISONS}}
    stem.with_suffix(".json").write_text(json.dumps(facts))
    return stem


def test_the_report_has_every_comparison_its_cost_and_the_held_out_check(tmp_path, capsys) -> None:
    stem = _stem(tmp_path)
    assert main(["--report", str(stem)]) == 0
    text = stem.with_suffix(".md").read_text()
    assert text == report(stem) and "committed in abc1234 at 2026-12-07 11:47 UTC" in text
    assert text.count("**yes: Derf beats DyT**") == 3  # lower bpb is better: 3 - top-1 keeps every order
    assert "50 cells (derf, dyt, layer, mrs, rms; lrs 0.1, 1; seeds 0, 1, 2, 3, 4), 5.0 CPU minutes." in text
    assert text.count("Beside them, not compared: `batch`, best lr 0.1, final_top1 0.9 [0.8") == 1  # the ResNet's own
    assert "- Derf - DyT: +0.1 here, +0.1 held out: **agrees** with the verdict's direction" in text
    tie = report(_stem(tmp_path, {**CURVES, "dyt": {0.1: 0.899, 1.0: 0.2}, "derf": {0.1: 0.899, 1.0: 0.3}}))
    assert "- Derf - DyT: +0 here, +0 held out: same sign; the verdict has no direction (its interval holds 0)" in tie
    # held out at lr 0.1 only: MRSNorm's best lr (1.0) has no held-out cell, so the check says so
    with pytest.raises(ValueError, match="no held-out cell of 'mrs' at its best lr 1"):
        held_out(verdicts(_rows(CURVES), "final_top1")[0], [r for r in _rows(CURVES) if r["lr"] == "0.1"], "final_top1")
    with pytest.raises(SystemExit):
        main([])


DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.mark.skipif(not (DOCS / "stress_alternatives.json").exists(), reason="the issue-64 report is not committed")
def test_the_committed_report_rebuilds_identically() -> None:
    assert report(DOCS / "stress_alternatives") == (DOCS / "stress_alternatives.md").read_text()
