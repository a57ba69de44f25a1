"""The P1t report (recipes/sweeps/p1t.py): its intervals against Newcombe's published values, the rule on made-up
cells, and the committed report rebuilt from its committed CSVs alone (identical)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.sweeps.p1t import MRS, MRS_AS_RMS, RMS, RMS_AS_MRS, newcombe, render, verdict, wilson
from recipes.sweeps.report import read_table

DOCS = Path(__file__).resolve().parents[3] / "docs"
STEM = DOCS / "stress_lm_p1t_stdlib"


def test_intervals_are_newcombes() -> None:
    # Newcombe 1998 (Stat. Med. 17: 857-872): 81/263 by Wilson's score, 0.2553-0.3662 (his companion paper's
    # example); 56/70 - 48/80 by the hybrid score (his method 10), 0.0524-0.3339
    assert wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    d, lo, hi = newcombe(56, 70, 48, 80)
    assert (d, lo, hi) == pytest.approx((0.2, 0.0524, 0.3339), abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and newcombe(0, 10, 0, 10)[1] < 0 < newcombe(0, 10, 0, 10)[2]


def _cells(counts: dict[str, tuple[int, int]]) -> list[dict]:
    return [{"norm": arm, "diverged": int(i < k)} for arm, (k, n) in counts.items() for i in range(n)]


@pytest.mark.parametrize(("counts", "expected"), [
    ({RMS: (5, 30), MRS: (3, 30), RMS_AS_MRS: (5, 30), MRS_AS_RMS: (3, 30)}, "1:"),
    ({RMS: (20, 30), MRS: (0, 30), RMS_AS_MRS: (20, 30), MRS_AS_RMS: (1, 30)}, "2:"),
    ({RMS: (20, 30), MRS: (0, 30), RMS_AS_MRS: (1, 30), MRS_AS_RMS: (19, 30)}, "3:"),
    ({RMS: (20, 30), MRS: (0, 30), RMS_AS_MRS: (20, 30), MRS_AS_RMS: (15, 30)}, "4:"),
    ({RMS: (20, 30), MRS: (0, 30)}, "1 only"),
])
def test_the_rule_picks_the_first_case_that_applies(counts: dict, expected: str) -> None:
    got, lines = verdict(_cells(counts), {})
    assert got.startswith(expected) and len(lines) == 5


@pytest.mark.skipif(not STEM.with_suffix(".csv").exists(), reason="the P1t report is not committed")
def test_committed_report_rebuilds_identically_from_its_csv() -> None:
    cells = read_table(STEM.with_suffix(".csv"), ("lr", "threads", "divergence_step", "final_bpb", "peak_absmax", "seed"))
    command = "python -m recipes.sweeps.p1t --stem docs/stress_lm_p1t_stdlib"
    assert render(cells, Path("docs/stress_lm_p1t_stdlib"), command) == STEM.with_suffix(".md").read_text()
