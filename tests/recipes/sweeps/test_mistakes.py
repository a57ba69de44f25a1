"""The mistakes a user makes with the sweep, through the script as a user runs it: one error line, nothing lost.

Every cell's settings are checked before the first cell runs (a mistake writes nothing), repeated grid
values are refused, Ctrl-C keeps the finished cells whatever ``--jobs``, a locked ``--out`` is refused
with the other process's id and a killed sweep's lock is free; and the report reads right on small grids.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import pytest

from helpers import ROOT
from helpers.scripts import run_script
from recipes.sweeps.lock import out_lock
from recipes.sweeps.kinds.norm import NORM
from recipes.sweeps.records import Row
from recipes.sweeps.report import verdict_command

SCRIPT = ROOT / "recipes" / "stress.py"
TINY = ["--dataset", "digits", "--norms", "mrs", "--lrs", "0.1", "--batch-sizes", "16", "--seeds", "0",
        "--max-steps", "1", "--log-every", "1", "--mrs-backend", "eager", "--jobs", "1"]
_run = partial(run_script, SCRIPT, timeout=300)


@pytest.mark.parametrize("argv,message", [
    (["--batch-sizes", "0"], "argument --batch-sizes: must be >= 1, got 0"),
    pytest.param(["--batch-sizes", "32", "5000"],
                 "--batch-sizes 5000: larger than the 1438 training images of --dataset digits", marks=pytest.mark.slow),
    pytest.param(["--arch", "resnet19"], "--arch 'resnet19': neither a torchvision classification model nor a timm model",
                 marks=pytest.mark.slow),
    (["--arch", "timm:vit_tiny_patch16_224"],
     "--arch 'timm:vit_tiny_patch16_224' cuts 16x16 patches, larger than --image-size 8: pass --arch-kwargs "
     "'{\"patch_size\": 2}'"),
    (["--seeds", "0", "0"], "--seeds lists 0 more than once"),
    (["--lrs", "0.1", "0.10"], "--lrs lists 0.1 more than once"),
    (["--norms", "mrs", "mrs"], "--norms lists mrs more than once"),
])
def test_a_mistake_is_one_line_in_the_sweeps_terms_and_writes_nothing(
        tmp_path: Path, argv: list[str], message: str, error_line: Callable[[int, str], str]) -> None:
    out = tmp_path / "sweep"
    proc = _run(["--dataset", "digits", "--quick", "--out", str(out), *argv], warnings=True)
    line = error_line(proc.returncode, proc.stderr)
    assert message in line and "--model." not in line and "--data." not in line
    assert not out.exists()  # no settings.json: the corrected command may use this --out


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_a_corrected_command_resumes_into_the_same_out(tmp_path: Path, error_line: Callable[[int, str], str]) -> None:
    out = tmp_path / "sweep"
    bad = _run([*TINY[:7], "16", "5000", *TINY[8:], "--out", str(out)], warnings=True)
    assert "--batch-sizes 5000" in error_line(bad.returncode, bad.stderr)
    good = _run([*TINY, "--out", str(out)])
    assert good.returncode == 0, good.stderr[-3000:]
    assert [p.name for p in (out / "cells").glob("*.json")] == ["mrs_lr0.1_bs16_seed0.json"]


def _sigint_as_in_a_terminal() -> None:
    """In the child: Ctrl-C's default action, also when pytest runs as a background job (which ignores SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _first_cell_then_ctrl_c(out: Path, jobs: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(SCRIPT), *TINY[:8], "--seeds", "0", "1", "2", "3", "--max-steps", "120", "--log-every", "40",
            "--mrs-backend", "eager", "--jobs", jobs, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_sigint_as_in_a_terminal)
    deadline = time.monotonic() + 240
    while not list((out / "cells").glob("*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("jobs", ["1", pytest.param("2", marks=pytest.mark.slow)])  # 2: two spawned workers, ~30 s
def test_ctrl_c_keeps_the_finished_cells_whatever_the_jobs(tmp_path: Path, jobs: str) -> None:
    out = tmp_path / "sweep"
    proc = _first_cell_then_ctrl_c(out, jobs)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "interrupted: finished cells are kept; rerun the same command to resume." in proc.stderr
    assert "Traceback" not in proc.stderr
    kept = sorted((out / "cells").glob("*.json"))
    assert 1 <= len(kept) < 4
    for path in kept:
        assert 0.0 <= json.loads(path.read_text())["final_top1"] <= 1.0
    assert not list((out / ".locks").glob("sweep*"))  # the lock went with the sweep


def test_a_locked_out_is_refused_with_the_other_process(tmp_path: Path, error_line: Callable[[int, str], str]) -> None:
    out = tmp_path / "sweep"
    out.mkdir()
    with out_lock(out):  # another sweep (driver), here this test, writes into --out
        proc = _run([*TINY, "--out", str(out)], warnings=True)
    line = error_line(proc.returncode, proc.stderr)
    assert f"--out {out} is in use by another sweep (process {os.getpid()} on " in line
    assert not (out / "cells").exists() and not (out / "settings.json").exists()


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_the_lock_of_a_killed_sweep_is_free(tmp_path: Path) -> None:
    """A sweep killed with -9 leaves its lock files; the operating system dropped the lock, so the next sweep runs."""
    out = tmp_path / "sweep"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from recipes.sweeps.lock import out_lock; held = out_lock(Path(sys.argv[1])); held.__enter__(); "
                               "print('locked', flush=True); time.sleep(600)", str(out)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        holder.kill()
        holder.wait(timeout=60)
        assert (out / ".locks" / "sweep").exists()  # what the killed sweep left
        proc = _run([*TINY, "--out", str(out)])
    finally:
        holder.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list((out / ".locks").glob("sweep*"))


def test_help_says_quick_is_inconclusive_and_how_the_lock_works() -> None:
    proc = _run(["--help"])
    text = " ".join(proc.stdout.split())
    assert "--quick runs one seed per cell, so every claim of its report is inconclusive by construction" in text
    assert "rerun without --quick for verdicts" in text
    assert "A second sweep into a running sweep's --out refuses to start and names it" in text
    assert "a dead sweep's lock is free" in text


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_a_small_report_shows_the_values_and_what_was_not_swept(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["--dataset", "digits", "--quick", "--norms", "mrs", "rms", "--lrs", "0.1", "--batch-sizes", "32",
            "--max-steps", "2", "--mrs-backend", "eager", "--jobs", "1", "--out", str(out)]
    proc = _run(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (out / "results.md").read_text()
    rows = {json.loads(p.read_text())["norm"]: json.loads(p.read_text()) for p in (out / "cells").glob("*.json")}
    mrs, rms = (f"{100 * rows[n]['final_top1']:.2f} % (n=1)" for n in ("mrs", "rms"))
    # the seeds that exist are shown, and the arm that was not swept is named as such
    assert f"| batch 32: mrs - layer | mrs {mrs}; layer: none | - | > -1.00 pt | inconclusive (layer was not in " \
           "this sweep) |" in md
    assert f"| batch 32: mrs - rms | mrs {mrs}; rms {rms} | - | > -1.00 pt | inconclusive (too few seeds: mrs " \
           "at lr 0.1, batch 32 has n=1 (needs 2)) |" in md
    # --quick: said at the top, with the command that would give verdicts
    top = md.split("## Setup")[0]
    assert "**Every claim below is inconclusive by construction:** this sweep ran 1 seed per cell" in top
    assert "`python recipes/stress.py --dataset digits --norms mrs rms --lrs 0.1 --batch-sizes 32 --max-steps 2 " \
           "--mrs-backend eager --jobs 1`" in top


def test_the_verdict_command_drops_quick_seeds_and_out() -> None:
    assert verdict_command("python recipes/stress.py --quick --seeds 0 --dataset digits --out runs/x --lrs 0.1") == \
        "python recipes/stress.py --dataset digits --lrs 0.1"


def test_a_one_panel_figure_keeps_its_whole_title(tmp_path: Path) -> None:
    rows = [Row(arm, 0.1, 32, 0, num_classes=10, final_top1=0.5) for arm in ("mrs", "rms")]
    axes = NORM.figure(rows, tmp_path / "one.png")
    figure = axes[0][0].figure
    figure.canvas.draw()
    title = figure._suptitle
    box, page = title.get_window_extent(), figure.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1  # inside the figure
    assert " ".join(title.get_text().split()) == ("Final top-1 vs learning rate: mean over 1 seed(s), band = min-max; "
                                                   "a diverged seed = chance")


def test_the_qk_figure_draws_before_any_logit_was_logged(tmp_path: Path) -> None:
    from recipes.sweeps.kinds.qk import figure

    (top, logit), = figure([Row("mrs", 0.01, 4, 0, num_classes=3, final_top1=0.4)], tmp_path / "qk.png")
    assert logit.get_yscale() == "linear" and (tmp_path / "qk.png").exists()
