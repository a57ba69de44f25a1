"""recipes/stress.py --sweep lm and --sweep lm-qk: tiny sweeps end to end, resume and refusals, and the
divergence and loss-scaler bookkeeping of a cell made to overflow on purpose."""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Callable

import pytest

from helpers.scripts import results_rows
from helpers.tensorboard import event_scalars, session_start
from recipes.stress import parse_args
from recipes.sweeps.kinds.lm import HEAD, LM, METRICS
from recipes.sweeps.kinds.lm_qk import LM_QK, figure as qk_figure
from recipes.sweeps.claims.mechanism import MAGNITUDES, MECHANISM_LR
from recipes.sweeps.rebuild import rebuild
from recipes.sweeps.records import read_csv
from recipes.sweeps.runner import run
from recipes.sweeps.score import DIVERGED_BPB

TINY_CONFIG = '{"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, ' \
              '"intermediate_size": 32}'
TINY = ["--lrs", "0.01", "--seeds", "0", "--max-steps", "4", "--log-every", "1", "--jobs", "1", "--mrs-backend", "eager",
        "--arch-kwargs", TINY_CONFIG]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_lm_sweep_end_to_end_resumes_and_refuses_other_settings(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                    error_line: Callable[[int, str], str]) -> None:
    out = tmp_path / "lm"
    argv = ["--sweep", "lm", "--lm-arms", "rms-fp16", "mrs-bf16", "mrs-fp32", "rms-half-fp16-true", *TINY, "--out",
            str(out)]
    assert run(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "4 to run (in this process)" in printed and "scaler skipped 0" in printed and "final val bpb" in printed
    raw = results_rows(out)
    assert list(raw[0]) == ["arm", "norm", "precision", *HEAD, *METRICS, "wall_s", "cpu_s", "device", "cpu_model",
                            "cpu_isa", "threads", "tb_run"]
    by_arm = {r.pop("arm"): r for r in raw}
    assert by_arm.keys() == {"rms-fp16", "mrs-bf16", "mrs-fp32", "rms-half-fp16-true"}
    # pure fp16: AdamW's eps rounds to 0 in float16, the first update is NaN (0/0) and the loss turns non-finite
    half = by_arm.pop("rms-half-fp16-true")
    assert (half["norm"], half["precision"], half["diverged"], half["divergence_step"]) == ("rms-half", "16-true", "1",
                                                                                           "2")
    cell = json.loads((out / "cells" / "lm-rms-half-fp16-true_lr0.01_bs16_seed0.json").read_text())
    assert cell["precision"] == "16-true" and float(half["final_bpb"]) == DIVERGED_BPB
    for arm, r in by_arm.items():
        assert (r["norm"], r["precision"]) == (arm.split("-")[0], {"fp16": "16-mixed", "bf16": "bf16-mixed",
                                                                   "fp32": "32-true"}[arm.split("-")[1]])
        assert r["steps"] == "4" and r["diverged"] == "0" and r["dataset"] == "stdlib"
        assert 0 < float(r["best_bpb"]) <= float(r["final_bpb"]) + 1e-9 < DIVERGED_BPB  # 1 validation at the end here
        assert 0 < float(r["max_rms_share"]) <= 1 and 0 < float(r["max_mrs_share"]) <= 1 and r["channels"] == "16"
        assert float(r["max_absmax"]) > 0 and 0 <= float(r["max_x2_over_fp16_frac"]) <= 1
        assert math.isfinite(float(r["mean_grad_cv"])) and 0 <= float(r["mean_starved_frac"]) <= 1
        assert float(r["max_logit"]) > 0  # the Llama's attention, exposed for the AttentionMonitor
        record = json.loads((out / "cells" / f"lm-{arm}_lr0.01_bs16_seed0.json").read_text())
        hparams = session_start(out / r["tb_run"])  # the cell in TensorBoard's HParams dashboard
        assert hparams["arm"].string_value == arm and hparams["precision"].string_value == record["precision"]
        assert hparams["lr"].number_value == 0.01 and hparams["seq_len"].number_value == 64
        scalars = event_scalars(out / r["tb_run"])
        assert scalars["z-final/final_bpb"] == [(4, pytest.approx(float(r["final_bpb"]), rel=1e-5))]
        assert record["precision"] == {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}[arm.split("-")[1]]
        if arm.endswith("fp16"):  # a real loss scaler: its bookkeeping (no growth within 2000 steps)
            assert float(r["scaler_final_scale"]) == 65536.0 / 2 ** int(r["scaler_skipped"])
        else:
            assert r["scaler_skipped"] == "" and r["scaler_final_scale"] == ""
    md = (out / "results.md").read_text()
    assert md.startswith("# Language-model norm stress sweep (stdlib)") and "- data: stdlib of Python" in md
    assert "| lr | batch | arm | seeds | final val bpb | best val bpb | divergence | skipped |" in md
    assert md.count("| inconclusive |") == 9 and "P1: Numerical explosion" in md and "counts as 8 bpb" in md
    assert "P1h: Numerical explosion as the paper states it" in md and "**Seeds needed.**" in md
    assert "- P1: 2 comparisons without an interval, so no spread to plan from" in md
    # the mechanism stress of the fp32 model at lr 0.01: its arms, 13 magnitudes, its section and figure
    mechanism = [r for r in csv.DictReader(open(out / "mechanism.csv"))]
    assert [(r["arm"], float(r["magnitude"])) for r in mechanism] == [(a, m) for a in ("mrs", "mrs-half", "mrs-half-safe")
                                                                      for m in (0.0, *MAGNITUDES)]
    # MRSNorm with its squares formed in float16 breaks from 256 on; upcast or by hypot it never does up to 2^15
    assert [r["bad_frac"] for r in mechanism if r["arm"] == "mrs-half"] == ["0"] * 5 + ["1"] * 8
    assert {r["bad_frac"] for r in mechanism if r["arm"] != "mrs-half"} == {"0"}
    record = json.loads((out / "cells" / "lm-mrs-fp32_lr0.01_bs16_seed0.json").read_text())
    assert float(mechanism[0]["val_bpb"]) == pytest.approx(record["final_bpb"], abs=0.02)  # fp16 vs fp32 inference
    assert "## Mechanism stress (pure float16, a planted channel)" in md and "| M: Mechanism" in md
    assert (out / "mechanism.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Learning-rate robustness" in md and "within 10 %" in md
    assert (out / "robustness.csv").read_text().startswith("arm,batch_size,n_lrs,lrs,complete,seeds,best_lr,best_bpb,")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    settings = json.loads((out / "settings.json").read_text())
    assert settings["sweep"] == "lm" and settings["seq_len"] == LM.datasets["stdlib"]["seq_len"]

    # the report rebuilt from the CSV files alone (recipes/sweeps/rebuild.py) is the report
    rebuilt = rebuild("lm", out / "results.csv", out / "results.md", tmp_path / "rebuilt")
    assert (rebuilt / "results.md").read_text() == md
    assert (rebuilt / "results.csv").read_text() == (out / "results.csv").read_text()

    assert run(argv) == 0  # resume: nothing left
    assert "0 to run" in capsys.readouterr().out
    changed = argv[:-2] + ["--weight-decay", "0.5", "--out", str(out)]
    status = run(changed)
    assert "holds a sweep with other settings (weight_decay: 0.1 there, 0.5 now" in error_line(
        status, capsys.readouterr().err)


def test_tiny_lm_qk_sweep_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "lmqk"
    argv = ["--sweep", "lm-qk", "--lm-qk-norms", "mrs", *TINY, "--out", str(out)]
    assert run(argv) == 0, capsys.readouterr().err
    assert "1 cells in the grid, 0 already done, 1 to run (in this process)" in capsys.readouterr().out
    assert [r["qk_norm"] for r in results_rows(out)] == ["mrs"]
    assert run(["--sweep", "lm-qk", "--lm-qk-norms", "none", "mrs", *argv[4:]]) == 0  # another arm: same --out
    assert "2 cells in the grid, 1 already done, 1 to run" in capsys.readouterr().out
    raw = results_rows(out)
    assert [r["qk_norm"] for r in raw] == ["none", "mrs"]
    for r in raw:
        assert float(r["max_logit"]) > 0 and r["scaler_skipped"] == ""
        record = json.loads((out / "cells" / f"lmqk-{r['qk_norm']}_lr0.01_bs16_seed0.json").read_text())
        assert record["precision"] == "bf16-mixed"
    md = (out / "results.md").read_text()
    assert md.startswith("# Language-model QK-norm stress sweep (stdlib)") and "body_norms: `the Llama's own" in md
    assert md.count("| inconclusive |") == 6 and "Q3: MRS QK-norm does better than QK-layernorm" in md
    rows = read_csv(out / "results.csv", LM_QK.arm_column, LM_QK.metric_columns)
    top, logit = qk_figure(rows, tmp_path / "again.png")
    lines = {line.get_label(): list(line.get_ydata()) for line in logit.get_lines() if line.get_label()[0] != "_"}
    assert lines == {r.arm: [pytest.approx(r.metrics["max_logit"], rel=1e-5)] for r in rows}
    assert logit.get_yscale() == "log" and "bpb" in top.get_title()


def test_an_fp16_cell_made_to_overflow(tmp_path: Path) -> None:
    """A learning rate of 1e4 throws the weights far past float16's range within a step or two: the loss
    turns non-finite, the cell stops there and counts as 8 bits per byte; the scaler's bookkeeping holds."""
    from recipes.sweeps.cells.lm import run_lm_cell

    args = parse_args(["--sweep", "lm", *TINY, "--max-steps", "20", "--out", str(tmp_path)])
    record = run_lm_cell(args, tmp_path, "boom", arm="rms-fp16", lr=1e4, batch_size=4, seed=0)
    assert record["diverged"] and 1 <= record["divergence_step"] < 20 and record["steps"] == record["divergence_step"]
    assert record["final_bpb"] == DIVERGED_BPB and record["best_bpb"] == DIVERGED_BPB  # never validated before
    assert record["curves"]["val_bpb"][-1] == [record["divergence_step"], DIVERGED_BPB]
    assert not math.isfinite(record["curves"]["train_loss"][-1][1])
    skipped, scale = record["scaler_skipped"], record["scaler_final_scale"]
    assert scale == 65536.0 / 2 ** skipped  # every skipped step halved the scale, none grew it
    scales = [s for _, s in record["curves"]["loss_scale"]]
    assert skipped == sum(b < a for a, b in zip([65536.0, *scales], scales))


def test_lm_defaults_and_refusals(capsys: pytest.CaptureFixture, error_line: Callable[[int, str], str]) -> None:
    args = parse_args(["--sweep", "lm"])
    assert args.dataset == "stdlib" and args.max_steps == LM.datasets["stdlib"]["max_steps"] and args.epochs is None
    assert args.arms == LM.grid["arms"] and args.lrs == LM.grid["lrs"] and args.out == str(Path("runs") / "stress_lm_stdlib")
    quick = parse_args(["--sweep", "lm-qk", "--quick"])
    assert quick.max_steps == LM_QK.quick["max_steps"]["stdlib"] and quick.out.endswith("stress_lm_qk_stdlib_quick")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--sweep", "lm", "--lm-arms", "rms-fp8"])
    assert "--lm-arms: invalid choice: 'rms-fp8'" in error_line(exit_.value.code, capsys.readouterr().err)
    status = run(["--sweep", "lm", "--precision", "bf16-mixed", *TINY, "--out", "/nonexistent/never"])
    assert "--precision: --sweep lm sets the precision per arm (--lm-arms)" in error_line(status, capsys.readouterr().err)


def test_fp32_reference_runs_at_the_ends_of_the_lr_axis() -> None:
    args = argparse.Namespace(lrs=[0.001, 0.01, 0.1, 1.0])
    kept = [lr for lr in args.lrs if LM.keep(("rms-fp32", lr, 16, 0), args)]
    assert kept == [0.001, MECHANISM_LR, 1.0] and all(LM.keep(("rms-fp16", lr, 16, 0), args) for lr in args.lrs)


def test_quick_has_the_half_arms_and_the_mechanism_models() -> None:
    """The acceptance of issue 30: --sweep lm --quick runs the half-internal arms in pure fp16 beside the shipped
    ones, and its fp32 models at the mechanism stress's lr."""
    args = parse_args(["--sweep", "lm", "--quick"])
    assert {"rms-half-fp16-true", "mrs-half-fp16-true", "rms-fp16-true", "mrs-fp16-true"} <= set(args.arms)
    assert MECHANISM_LR in args.lrs and any(LM.keep((a, MECHANISM_LR, 16, 0), args) for a in ("rms-fp32", "mrs-fp32"))
