"""docs/results.md's "The same comparison on your own data": its commands, as written, on a tiny image folder and a
tiny text file (with a smaller budget appended: later options win), then the rule on each sweep's results.csv."""

from __future__ import annotations

import csv
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT
from helpers.scripts import results_rows, run_script
from recipes.sweeps.alternatives import ARMS, MIN_SEEDS

DOC = ROOT / "docs" / "results.md"
SMALL = ["--lrs", "0.01", "--jobs", "1", "--mrs-backend", "eager", "--accelerator", "cpu"]


def _commands() -> list[list[str]]:
    section = DOC.read_text().split("### The same comparison on your own data", 1)[1]
    return [shlex.split(line) for block in re.findall(r"```bash\n(.*?)```", section, re.S) for line in block.splitlines()]


def _run_pair(sweep: list[str], rule: list[str], substitutions: dict[str, str], extra: list[str]) -> str:
    sweep = [substitutions.get(a, a) for a in sweep]
    proc = run_script(ROOT / sweep[1], sweep[2:] + SMALL + extra, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = results_rows(Path(sweep[sweep.index("--out") + 1]))
    assert sorted({r["norm"] for r in rows}) == sorted(ARMS) and len({r["seed"] for r in rows}) == MIN_SEEDS
    rule = [substitutions.get(a, a) for a in rule]
    out = subprocess.run([sys.executable, *rule[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow  # 50 short Lightning fits in two sweeps: about 25 s on 2 idle cores
def test_the_documented_commands_run_the_five_arms_and_the_rule(tmp_path: Path) -> None:
    from PIL import Image
    import numpy as np

    vit, vit_rule, lm, lm_rule = _commands()
    assert vit[:4] == ["python", "recipes/stress.py", "--sweep", "norm-vit"] and lm[3] == "lm"
    rng = np.random.default_rng(0)
    images = tmp_path / "images"
    for c in range(3):
        (images / f"c{c}").mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8) // (c + 1)).save(images / f"c{c}" / f"{i}.png")
    text = tmp_path / "text.txt"
    text.write_text(Path(json.__file__).read_text() + Path(csv.__file__).read_text())  # real text: stdlib sources
    subs = {"DIR": str(images), "TEXT": str(text), "runs/alternatives_vit": str(tmp_path / "vit"),
            "runs/alternatives_vit/results.csv": str(tmp_path / "vit" / "results.csv"),
            "runs/alternatives_lm": str(tmp_path / "lm"), "runs/alternatives_lm/results.csv": str(tmp_path / "lm" / "results.csv")}
    for sweep, rule, extra in ((vit, vit_rule, ["--epochs", "1", "--image-size", "8", "--batch-sizes", "4"]),
                               (lm, lm_rule, ["--max-steps", "2", "--seq-len", "16"])):
        report = _run_pair(sweep, rule, subs, extra)
        assert all(f"{k}. " in report for k in "123") and "Derf - DyT" in report and "| `derf` |" in report
