"""recipes/stress.py: a tiny digits sweep through the real command line, its resume, its help, its parts."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Callable

import pytest
import torch

from helpers import ROOT
from helpers.scripts import results_rows, run_script
from recipes import stress
from recipes.sweeps.kinds import DEFAULT, SWEEPS
from recipes.sweeps.kinds.norm import NORM
from recipes.sweeps.records import write_atomic
from recipes.sweeps.report import write_outputs

DATASET_DEFAULTS = NORM.datasets
DEFAULT_GRID = {"norms": NORM.grid["arms"], **{k: v for k, v in NORM.grid.items() if k != "arms"}}

SCRIPT = ROOT / "recipes" / "stress.py"
GRID = ["--dataset", "digits", "--norms", "layer", "mrs", "--lrs", "0.1", "--batch-sizes", "16",
        "--max-steps", "3", "--log-every", "1", "--mrs-backend", "eager", "--accelerator", "cpu"]


_run = partial(run_script, SCRIPT, timeout=400)


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_sweep_then_resume(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = _run([*GRID, "--seeds", "0", "--jobs", "1", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 to run (in this process)" in proc.stdout

    rows = results_rows(out)
    assert [(r["norm"], r["lr"], r["batch_size"], r["seed"]) for r in rows] == [
        ("layer", "0.1", "16", "0"), ("mrs", "0.1", "16", "0")]
    for r in rows:
        assert r["steps"] == "3" and r["planned_steps"] == "3" and r["diverged"] == "0" and r["divergence_step"] == ""
        assert r["dataset"] == "digits" and r["num_classes"] == "10" and float(r["cpu_s"]) > 0
        assert 0.0 <= float(r["best_top1"]) <= 1.0 and 0.0 <= float(r["final_top1"]) <= 1.0
        assert float(r["best_top1"]) >= float(r["final_top1"])
        assert math.isfinite(float(r["mean_grad_cv"])) and 0.0 <= float(r["mean_starved_frac"]) <= 1.0
        tb = out / r["tb_run"]
        assert tb.name == f"{r['norm']}_lr0.1_bs16_seed0" and list(tb.glob("events.out.tfevents.*"))
    md = (out / "results.md").read_text()
    assert "| 0.1 | 16 | layer | 1 |" in md and "| 0.1 | 16 | mrs | 1 |" in md
    assert "max_steps: `3`" in md and "--max-steps 3" in md  # the exact settings are stated
    assert "split: `stratified per class, 20 % held out" in md and "optimizer: `SGD" in md
    # one seed, none of the paper's cells: every claim is inconclusive, and says why
    assert "## Claims" in md and "**Decision rule.**" in md and md.count("| inconclusive |") == 5
    assert "missing cells" in md and "## Learning-rate robustness" in md
    assert (out / "robustness.csv").read_text().startswith("norm,batch_size,")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # an interrupted sweep: one finished cell lost its record, another seed is new -> only those
    # run, two at a time in the local Dask cluster's worker processes, each record naming its worker
    (out / "cells" / "mrs_lr0.1_bs16_seed0.json").unlink()
    proc = _run([*GRID, "--seeds", "0", "1", "--jobs", "2", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 cells in the grid, 1 already done, 3 to run (2 local worker processes)" in proc.stdout
    rows = results_rows(out)
    keys = [(r["norm"], r["seed"]) for r in rows]
    assert sorted(keys) == [("layer", "0"), ("layer", "1"), ("mrs", "0"), ("mrs", "1")]
    workers = [json.loads(p.read_text())["worker"] for p in sorted((out / "cells").glob("*.json"))]
    assert workers[0] == "this process" and all(w.startswith("tcp://127.0.0.1:") for w in workers[1:]), workers

    # a plain rerun: nothing trains, nothing is appended, and torch is never imported
    before = (out / "results.csv").read_text()
    code = (
        "import runpy, sys; sys.argv = ['stress.py', *sys.argv[1:]]\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code\n"
        "assert 'torch' not in sys.modules, 'a rerun with nothing to do imported torch'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *GRID, "--seeds", "0", "1", "--out", str(out)],
                          cwd=ROOT / "recipes", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0 to run" in proc.stdout
    assert (out / "results.csv").read_text() == before


def test_rerun_with_other_settings_is_refused(tmp_path: Path, error_line: Callable[[int, str], str]) -> None:
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "settings.json").write_text(json.dumps({"dataset": "digits", "max_steps": 999}))
    proc = _run([*GRID, "--seeds", "0", "--out", str(out)], timeout=120)
    line = error_line(proc.returncode, proc.stderr)
    assert "other settings" in line and "max_steps: 999 there, 3 now" in line
    assert not (out / "results.csv").exists()


def test_divergence_stops_the_cell_and_is_recorded() -> None:
    """A loss that turns NaN at step 3: the run stops there and the step is recorded."""
    import lightning.pytorch as pl
    from recipes.sweeps.cells.image import DivergenceStop, MemoryLogger

    class Bomb(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = (self.w * batch).sum() ** 2
            return loss * float("nan") if self.global_step == 2 else loss  # 3rd optimizer step

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.ones(20, 2), batch_size=1)
    stop, memory = DivergenceStop(), MemoryLogger()
    trainer = pl.Trainer(accelerator="cpu", max_steps=20, callbacks=[stop], logger=memory, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Bomb(), data)
    assert stop.divergence_step == 3
    assert trainer.global_step == 3
    assert [s for s, _ in stop.losses] == [1, 2, 3]
    assert all(math.isfinite(v) for _, v in stop.losses[:2]) and math.isnan(stop.losses[2][1])


def test_table_aggregates_seeds_and_marks_divergence(tmp_path: Path) -> None:
    def record(norm: str, seed: int, top1: float, diverged: bool = False, step: int | None = None) -> dict:
        return {"cell": f"{norm}_{seed}", "norm": norm, "lr": 0.4, "batch_size": 32, "seed": seed, "num_classes": 10,
                "final_top1": top1, "best_top1": top1, "diverged": diverged, "divergence_step": step,
                "mean_grad_cv": 0.5, "mean_starved_frac": 0.1}

    (tmp_path / "cells").mkdir()
    records = [record("mrs", 0, 0.5), record("mrs", 1, 0.7), record("rms", 0, 0.1, True, 7),
               record("rms", 1, 0.3)]
    for r in records:
        write_atomic(tmp_path / "cells" / f"{r['cell']}.json", json.dumps(r))
    write_outputs(tmp_path, NORM, {"max_steps": 10}, "python recipes/stress.py ...")
    md = (tmp_path / "results.md").read_text()
    # mean and sample std over seeds, in %: (50, 70) -> 60 +- 14.14; (10 = chance, 30) -> 20 +- 14.14
    assert f"| 0.4 | 32 | mrs | 2 | 60.00 ± {math.sqrt(200):.2f} |" in md
    assert f"| 0.4 | 32 | rms | 2 | 20.00 ± {math.sqrt(200):.2f} |" in md
    assert "**DIVERGED 1/2 @ 7**" in md
    assert len(results_rows(tmp_path)) == 4
    assert (tmp_path / "results.png").exists()


def _help_blocks() -> dict[str, str]:
    proc = _run(["--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    blocks: dict[str, str] = {}
    name = None
    for line in proc.stdout.splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = line
        elif name and line.startswith("   "):
            blocks[name] += " " + line.strip()
        else:
            name = None
    return blocks


def test_help_shows_every_default_once() -> None:
    blocks = _help_blocks()
    assert len(blocks) > 25
    for name, text in blocks.items():
        if name != "-h":
            assert text.count("(default:") == 1 and "default: None" not in text, text
    # the per-dataset defaults in the help are the ones the code fills in
    digits = DATASET_DEFAULTS["digits"]
    assert f"digits {digits['epochs']};" in blocks["--epochs"] and f"digits {digits['image_size']};" in blocks[
        "--image-size"]
    args = stress.parse_args(["--dataset", "digits"])
    assert (args.epochs, args.image_size, args.arch, args.arch_kwargs, args.augment) == (
        digits["epochs"], digits["image_size"], digits["arch"], digits["arch_kwargs"], digits["augment"])
    assert (args.norms, args.lrs, args.batch_sizes, args.seeds) == tuple(DEFAULT_GRID.values())
    assert args.out == str(Path("runs") / "stress_digits") and args.warmup_frac == 0.0


def test_docstring_states_the_code_defaults() -> None:
    doc = stress.__doc__
    digits = DATASET_DEFAULTS["digits"]
    listed = lambda key: " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in DEFAULT_GRID[key])  # noqa: E731
    assert f"lrs {listed('lrs')};" in doc and f"batch sizes {listed('batch_sizes')};" in doc
    assert f"norms {listed('norms')};" in doc and f"seeds {listed('seeds')};" in doc
    assert f"{digits['epochs']} epochs" in doc and digits["arch"].split(":")[-1] in doc
    assert f"{digits['image_size']}x{digits['image_size']}" in doc


@pytest.mark.parametrize("argv,message", [
    (["--max-steps", "0"], "--max-steps"), (["--max-steps", "1", "--slurm-gpus", "2"], "--slurm-gpus"), ([], "--epochs"),
    (["--dataset", "digits", "--lrs", "x"], "--lrs"),
])
def test_bad_arguments(tmp_path: Path, argv: list[str], message: str, error_line: Callable[[int, str], str]) -> None:
    proc = _run(["--out", str(tmp_path / "x"), *argv], timeout=60)
    assert message in error_line(proc.returncode, proc.stderr)


@pytest.mark.parametrize("kind", list(SWEEPS))
def test_help_fits_two_screens_and_lists_each_arm_once(kind: str, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """``--sweep KIND --help``: grouped, its defaults only, the usage one line, each of its arms once in its option."""
    monkeypatch.setenv("COLUMNS", "80")  # what a terminal of 80 columns shows
    with pytest.raises(SystemExit):
        stress.parse_args(["--sweep", kind, "--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 180 and len(text) <= 11_000, (len(text.splitlines()), len(text))  # was 268, 19 KB
    usage = text.split("\n\n")[0]
    assert len(usage) < 200 and "{" not in usage  # no choice list in the usage line
    groups = re.findall(r"^(\S[^\n]*):$", text, flags=re.M)
    assert groups[1:] == ["what to sweep", "training", "data and model", "where to run",
                          "on a cluster (the [cluster] extra: dask.distributed, dask-jobqueue)", "output"]
    sweep, flat = SWEEPS[kind], " ".join(text.split())
    listed = re.findall(r"(?<![\w-])" + r" ".join(re.escape(a) + r"(\*?)" for a in sweep.arms) + r"(?![\w-])", flat)
    assert len(listed) == 1  # the arms, in order, once
    assert [mark == "*" for mark in listed[0]] == [a in sweep.grid["arms"] for a in sweep.arms]  # defaults marked
    others = [k for k in SWEEPS.values() if k is not sweep]
    assert all(f"{k.flag} ARM [ARM ...]" in flat and f"listed by --sweep {k.name} --help" in flat for k in others)


@pytest.mark.parametrize("kind", list(SWEEPS))
def test_help_lists_each_choice_list_once(kind: str, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    """Each choice list once: the kinds in ``--sweep``'s help, the kind's datasets in ``--dataset``'s (a per-dataset
    default names its exceptions and "others"), no ``{a,b}`` in an option line; the default ``--help`` (``--sweep
    norm``, 80 columns: a terminal's or a pipe's) within 8,000 characters (8,887 when datasets were listed 8 times)."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        stress.parse_args(["--sweep", kind, "--help"])
    text = capsys.readouterr().out
    blocks = re.split(r"\n(?=  -|\S)", text)

    def listing(names: list[str]) -> list[str]:  # the options whose help names every one of ``names``
        return [b.split()[0] for b in blocks if all(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", b) for n in names)]

    assert listing(list(SWEEPS)) == ["--sweep"]
    assert listing(list(SWEEPS[kind].datasets)) == ["--dataset"]
    assert not [line for line in text.splitlines() if line.startswith("  -") and "{" in line]
    if kind == DEFAULT:  # what `python recipes/stress.py --help` prints
        assert len(text) <= 8000, len(text)


def test_a_cells_model_does_not_depend_on_what_its_process_built_before(tmp_path: Path) -> None:
    """The first cell of a fresh process (a Dask worker's first) and a later one start from the same weights: the
    model the input-size probe builds and throws away draws nothing from the seeded random stream."""
    import lightning.pytorch as pl
    from recipes.sweeps.cells import image

    args = stress.parse_args([*GRID, "--seeds", "0", "--out", str(tmp_path)])
    image._sized.cache_clear()  # as in a fresh worker process
    pl.seed_everything(0, verbose=False)
    first = image.build_model(args, "layer", 0.1, 10).state_dict()
    pl.seed_everything(0, verbose=False)
    later = image.build_model(args, "layer", 0.1, 10).state_dict()  # the probe's result cached
    assert first.keys() == later.keys() and all(torch.equal(first[k], later[k]) for k in first)
