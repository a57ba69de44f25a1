"""A sweep kind is one module and one registry line: a tiny kind, defined here, runs end to end.

The kind below varies the classifier's lr schedule, measures the mean training loss from the
cells' logs, words one claim of its own and draws its own figure; nothing in ``recipes/sweeps``
knows it. It runs through the real runner (in this process: its functions live in this test) on
synthetic data, and the outputs carry its arm column, its metric, its claim and its table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from helpers.scripts import results_rows
from recipes.sweeps import figure as fig
from recipes.sweeps import kinds as registry
from recipes.sweeps.claims.engine import Claim, arm_values, welch_comparison
from recipes.sweeps.claims.markdown import DECISION_RULE
from recipes.sweeps.kind import History, Measured, Sweep
from recipes.sweeps.records import Row, read_csv
from recipes.sweeps.runner import main, run
from recipes.sweeps.series import finite_mean


def _claims(rows: list[Row]) -> list[Claim]:
    def loss(row: Row) -> Any:
        return row.metrics.get("mean_train_loss")

    lr, bs = rows[0].lr, rows[0].batch_size
    comparison = welch_comparison("constant - cosine", ("constant", arm_values(rows, "constant", lr, bs, loss)),
                                  ("cosine", arm_values(rows, "cosine", lr, bs, loss)), "below", 0.0, unit="")
    return [Claim("S", "a constant lr lowers the mean training loss", "nobody said so", "Welch, below 0",
                  groups=[("mean training loss", [comparison])])]


def _figure(rows: list[Row], path: Path) -> Any:
    plt = fig.pyplot()
    figure, ax = plt.subplots(figsize=(4, 3), constrained_layout=True)
    fig.lines(ax, rows, rows[0].batch_size, lambda r: r.metrics.get("mean_train_loss"))
    handles, labels = ax.get_legend_handles_labels()
    fig.save(plt, figure, handles, labels, "mean training loss against the learning rate", path)
    return ax


def _measure(history: History) -> Measured:
    return {"mean_train_loss": finite_mean(history.get("train/loss", []))}, {}


def _no_monitors(args: argparse.Namespace) -> list[Any]:
    return []


def _schedule(arm: str) -> dict[str, Any]:
    if arm == "boom":  # the failing kind's arm: fine while the settings are checked, fails in a worker
        if multiprocessing.current_process().name != "MainProcess":
            raise RuntimeError("boom")
        return {"norm": "batch"}
    return {"norm": "batch", "schedule": arm}


SCHEDULE = Sweep(
    name="schedule", arm_column="schedule", flag="--schedules", arms=("cosine", "constant"),
    arms_help="lr schedules to compare", grid={"arms": ["cosine", "constant"], "lrs": [0.05], "batch_sizes": [8],
                                             "seeds": [0, 1]},
    quick={"seeds": [0]},
    datasets={"synthetic": {"arch": "timm:resnet18", "cifar_stem": True, "image_size": 8, "augment": False,
                            "epochs": 1, "accelerator": "cpu",
                            "arch_kwargs": {"layers": [1, 1, 1, 1], "channels": [4, 8, 8, 8], "stem_width": 4}}},
    optimizer="sgd", weight_decay=0.0, warmup_frac=0.0, optimizer_text="plain SGD", help="schedule: a test kind",
    model_arms=_schedule, monitors=_no_monitors, measure=_measure,
    metric_columns=("mean_train_loss",), table=(("mean train loss", "mean_train_loss"),),
    table_note="mean train loss: over the logged steps.", claims=_claims, rule=("Test rule.", "", *DECISION_RULE),
    figure=_figure, title="Schedule sweep", arm_label="schedule", plotted="the mean training loss",
    cell_prefix="sched-", out_stem="stress_schedule",
)


def test_a_kind_defined_in_a_test_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sweep"
    argv = ["--sweep", "schedule", "--dataset", "synthetic", "--synthetic-train-size", "32",
            "--synthetic-val-size", "16", "--max-steps", "2", "--log-every", "1", "--jobs", "1", "--out", str(out)]
    assert run(argv, kinds={"schedule": SCHEDULE}) == 0, capsys.readouterr().err
    assert "4 to run (in this process)" in capsys.readouterr().out
    raw = results_rows(out)
    assert list(raw[0]) == ["schedule", "lr", "batch_size", "seed", "arch", "dataset", "num_classes", "steps",
                            "planned_steps", "best_top1", "final_top1", "final_val_loss", "final_train_loss",
                            "diverged", "divergence_step", "mean_train_loss", "wall_s", "cpu_s", "device", "cpu_model",
                            "cpu_isa", "threads", "tb_run"]
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    assert {(r["device"], r["cpu_isa"], r["threads"]) for r in raw} == {("cpu", isa, str(torch.get_num_threads()))}
    assert raw[0]["cpu_model"].endswith(")") and raw[0]["cpu_model"] != "unknown CPU ()"
    assert sorted((r["schedule"], r["seed"]) for r in raw) == [("constant", "0"), ("constant", "1"),
                                                               ("cosine", "0"), ("cosine", "1")]
    rows = read_csv(out / "results.csv", "schedule", ("mean_train_loss",))
    for r in rows:
        assert r.steps == 2 and r.metrics["mean_train_loss"] > 0
        assert (out / "cells" / f"sched-{r.arm}_lr0.05_bs8_seed{r.seed}.json").exists()
        record = json.loads((out / "cells" / f"sched-{r.arm}_lr0.05_bs8_seed{r.seed}.json").read_text())
        assert record["mean_train_loss"] == pytest.approx(r.metrics["mean_train_loss"], rel=1e-5)
    md = (out / "results.md").read_text()
    assert md.startswith("# Schedule sweep (synthetic)") and "Test rule." in md
    assert f"- machine: {raw[0]['cpu_model']} (vector ISA: torch's CPU capability {isa}), " \
           f"{torch.get_num_threads()} thread(s) per cell: 4 cells" in md
    assert "| S: a constant lr lowers the mean training loss |" in md and "constant - cosine" in md
    assert "| lr | batch | schedule | seeds | final top-1 | best top-1 | divergence | mean train loss |" in md
    assert (out / "robustness.csv").read_text().startswith("schedule,batch_size,")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "settings.json").read_text())["optimizer"] == "plain SGD"


def test_the_registry_is_one_line_per_kind() -> None:
    source = Path(registry.__file__).read_text()
    for kind in registry.SWEEPS.values():
        assert source.count(f"    {kind.name.upper().replace('-', '_')},\n") == 1  # its line in the registry
        assert kind.cell_name("a", 0.1, 8, 0).startswith(kind.cell_prefix)
    prefixes = [k.cell_prefix for k in registry.SWEEPS.values()]
    assert len(set(prefixes)) == len(prefixes)  # cells of different kinds never share an id


@pytest.mark.slow  # two spawned workers importing torch and Lightning: ~20-40 s
def test_cells_running_beside_a_failing_one_are_kept(tmp_path: Path) -> None:
    """--jobs 2: one cell fails at once in its worker, the other goes on, finishes and is kept."""
    failing = dataclasses.replace(SCHEDULE, arms=("boom", "cosine"))
    out = tmp_path / "sweep"
    argv = ["--sweep", "schedule", "--schedules", "boom", "cosine", "--seeds", "0", "--dataset", "synthetic",
            "--synthetic-train-size", "32", "--synthetic-val-size", "16", "--max-steps", "2", "--jobs", "2",
            "--out", str(out)]
    with pytest.raises(RuntimeError, match="boom"):
        main(argv, kinds={"schedule": failing})
    assert [p.name for p in (out / "cells").glob("*.json")] == ["sched-cosine_lr0.05_bs8_seed0.json"]
    assert [r["schedule"] for r in results_rows(out)] == ["cosine"]  # the report was rebuilt with it
