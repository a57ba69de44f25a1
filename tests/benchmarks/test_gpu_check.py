"""``benchmarks/gpu_check.py`` on a machine without a GPU: one line and a non-zero status, the
``--dry-run`` listing, its checks run on the CPU (``--device cpu``: the same code as on CUDA)
and catching a wrong kernel, the budget and the table, and its recipe commands against the
recipes' own ``--help``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402 - the benchmark under test
import gpu_check_ops  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the check would run")
def test_without_cuda_one_line_and_a_nonzero_status() -> None:
    out = _run()
    assert out.returncode == 2
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert lines == [gpu_check.NO_CUDA]
    assert "Traceback" not in out.stderr


def test_dry_run_lists_every_check_and_runs_nothing() -> None:
    out = _run("--dry-run")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for group in gpu_check.GROUPS:
        assert f"\n{group} " in "\n" + text, group
    for backend in ("triton", "inductor", "eager", "auto"):
        for dtype in ("float32", "bfloat16", "float16"):
            assert f"{backend} {dtype}" in text
    assert "pytest -m cuda" in text and "--trainer.devices 2" in text and "--trainer.strategy fsdp2" in text
    assert "--trainer.precision 16-mixed" in text and "--trainer.precision bf16-mixed" in text
    ctx = gpu_check.Context("cuda", 1, 1, Path("/tmp"), ["triton", "inductor", "eager", "auto"])
    assert text.strip().splitlines()[-1].startswith(f"{len(gpu_check.checks(ctx))} checks, ~")
    assert "Traceback" not in out.stderr


def test_the_op_checks_pass_on_the_cpu_and_the_table_has_one_row_each(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    report = tmp_path / "rows.json"
    status = gpu_check.main(["--device", "cpu", "--only", "ops", "--backends", "auto", "cpp",
                             "--json", str(report)])
    rows = json.loads(report.read_text())
    assert status == 0, rows
    assert [r["check"] for r in rows] == [f"{b} {d}" for b in ("auto", "cpp") for d in gpu_check.DTYPES]
    assert all(r["status"] == "PASS" and r["figures"]["worst"] <= 1.0 for r in rows)
    assert all(not r["figures"]["refused"] for r in rows if r["check"].startswith("auto"))  # auto runs every layout
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("gpu_check on CPU") and printed[-1].startswith("6 checks: 6 PASS, 0 FAIL")


def test_a_wrong_kernel_fails_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gpu_check_ops.mrs_norm

    def off_by_a_percent(x: torch.Tensor, w: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return real(x, w, **kwargs) * 1.01

    monkeypatch.setattr(gpu_check_ops, "mrs_norm", off_by_a_percent)
    out = gpu_check_ops.check_backend_dtype("auto", torch.float32, "cpu", lambda layout: False)
    assert not out.ok and len(out.failed) == len(gpu_check_ops.LAYOUTS) and out.worst > 100
    assert gpu_check._outcome(out, len(gpu_check_ops.LAYOUTS))[0] == "FAIL"


def test_an_unexpected_refusal_fails_and_an_expected_one_does_not() -> None:
    # the cpp kernels refuse NCHW per position: a failure unless the check expects it
    layouts = ["nchw_per_position", "tokens"]
    strict = gpu_check_ops.check_backend_dtype("cpp", torch.float32, "cpu", lambda layout: False, layouts)
    lenient = gpu_check_ops.check_backend_dtype("cpp", torch.float32, "cpu", lambda layout: True, layouts)
    assert not strict.ok and "nchw_per_position" in strict.failed[0]
    assert lenient.ok and lenient.refused == ["nchw_per_position"]


def test_the_reference_is_the_formula_of_the_method() -> None:
    x = torch.tensor([[3.0, 4.0, 0.0, 1.0]], dtype=torch.float64)  # phasor magnitudes 5 and 1: S = 3
    y = gpu_check_ops.reference(x, None, -1, False, eps=0.0)
    torch.testing.assert_close(y, x / 3)


def test_speed_case_times_every_module_and_reports_ratios_and_bandwidth() -> None:
    case = gpu_check_ops.scaled(gpu_check_ops.SPEED_CASES[0], 256)  # (32, 1024) tokens
    res = gpu_check_ops.speed_case(case, torch.float32, "cpu", iters=2, rounds=2)
    assert {"MRSNorm", "F.layer_norm", "F.rms_norm"} <= set(res.ms) and all(ms > 0 for ms in res.ms.values())
    assert res.bandwidth == pytest.approx(5 * 32 * 1024 * 4 / (res.ms["MRSNorm"] * 1e-3))
    line = res.summary(copy_bw=res.bandwidth * 2, peak_bw=None)
    ratio = res.ms["MRSNorm"] / res.ms["F.layer_norm"]
    assert line.startswith("MRSNorm ") and f"x{ratio:.2f} F.layer_norm" in line and "50% of copy" in line


def _ctx(tmp_path: Path, gpus: int = 1) -> gpu_check.Context:
    return gpu_check.Context("cpu", gpus, 64, tmp_path, ["auto"])


def test_budget_gpus_and_crashes_become_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "BUDGET", [10.0])

    def boom(ctx: gpu_check.Context) -> tuple[str, str, dict]:
        raise RuntimeError("kernel exploded")

    checks = [
        gpu_check.Check("ops", "fits", 1, lambda ctx: ("PASS", "fine", {})),
        gpu_check.Check("ops", "too long", 60, lambda ctx: ("PASS", "never run", {})),
        gpu_check.Check("multi-gpu", "two GPUs", 1, lambda ctx: ("PASS", "never run", {}), gpus=2),
        gpu_check.Check("ops", "crashes", 1, boom),
    ]
    rows = gpu_check.run_checks(checks, _ctx(tmp_path), lambda row: None)
    assert [r.status for r in rows] == ["PASS", "SKIP", "SKIP", "FAIL"]
    assert "time budget" in rows[1].result and "needs 2 GPUs, 1 visible" in rows[2].result
    assert "RuntimeError: kernel exploded" in rows[3].result
    assert gpu_check.summary(rows, 3.0) == "4 checks: 1 PASS, 1 FAIL, 2 SKIP, 0 INFO in 3 s"


def test_the_compiled_lm_row_asks_for_compile_in_a_run_folder_of_its_own(tmp_path: Path) -> None:
    plain, _ = gpu_check.recipe_command("recipes/lm.py", "bf16-mixed", "cuda", 1, None, tmp_path)
    compiled, _ = gpu_check.recipe_command("recipes/lm.py", "bf16-mixed", "cuda", 1, None, tmp_path, compiled=True)
    assert compiled[-2:] == ["--model.compile", "true"] and "--model.compile" not in plain
    folder = compiled.index("--trainer.default_root_dir") + 1
    assert compiled[folder] != plain[plain.index("--trainer.default_root_dir") + 1]
    # an option the recipe's --help lacks fails the check instead of running something else
    _, notes = gpu_check.recipe_command("recipes/lm.py", "bf16-mixed", "cuda", 1, None, tmp_path,
                                        {"--trainer.precision"}, compiled=True)
    assert any(note.startswith("its --help lacks") and "--model.compile" in note for note in notes)


@pytest.mark.slow  # two recipe --help runs: ~10 s each
@pytest.mark.parametrize("script", ["recipes/cifar100.py", "recipes/lm.py"])
def test_every_recipe_flag_exists_in_the_recipes_help(script: str, tmp_path: Path) -> None:
    flags = gpu_check.help_flags(script)
    assert "--trainer.precision" in flags  # the help was read
    for devices, strategy in ((1, None), (2, "ddp")):
        cmd, notes = gpu_check.recipe_command(script, "bf16-mixed", "cuda", devices, strategy, tmp_path, flags)
        assert not any(note.startswith("its --help lacks") for note in notes), notes
        assert cmd[cmd.index("--trainer.accelerator") + 1] == "gpu"
    if script == "recipes/lm.py":  # the compiled LM row's option too
        _, notes = gpu_check.recipe_command(script, "bf16-mixed", "cuda", 1, None, tmp_path, flags, compiled=True)
        assert not any(note.startswith("its --help lacks") for note in notes), notes


@pytest.mark.slow
def test_the_recipe_and_pytest_checks_run_on_the_cpu(tmp_path: Path) -> None:
    report = tmp_path / "rows.json"
    status = gpu_check.main(["--device", "cpu", "--only", "recipes", "pytest", "--budget", "1500",
                             "--json", str(report)])
    rows = {r["check"]: r for r in json.loads(report.read_text())}
    assert status == 0, rows
    assert rows["recipes/cifar100.py 16-mixed"]["status"] == "PASS"
    assert rows["recipes/lm.py bf16-mixed"]["status"] == "PASS"
    assert rows["recipes/lm.py bf16-mixed compiled"]["status"] == "PASS"
    assert "--model.compile" in rows["recipes/lm.py bf16-mixed compiled"]["figures"]["command"]
    assert rows["pytest -m cuda"]["status"] == "SKIP"  # every CUDA test skips here
