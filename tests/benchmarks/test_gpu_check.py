"""``benchmarks/gpu_check.py`` on a machine without a GPU: one line and a non-zero status, the
``--dry-run`` plan and its estimate against the budget, the groups run in worker subprocesses on
the CPU (``--device cpu``: the same code as on CUDA) with every row in ``results.csv`` and
``results.md``, a dying worker costing one row, the checks catching a wrong kernel (the one-ulp
half gradient catching one that the loose tolerance passes), the speed row's ratio, and the
recipe commands against the recipes' own ``--help``."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402 - the benchmark under test
import gpu_check_ops  # noqa: E402
import gpu_check_speed  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


def _ctx(tmp_path: Path, device: str = "cuda") -> gpu_check.Context:
    backends = ["triton", "auto", "eager"] if device == "cuda" else ["cpp", "eager", "auto"]
    return gpu_check.Context(device, 1, 1, tmp_path, backends)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the check would run")
def test_without_cuda_one_line_and_a_nonzero_status(tmp_path: Path) -> None:
    out = _run("--out", str(tmp_path / "out"))
    assert out.returncode == 2
    assert (out.stdout + out.stderr).strip().splitlines() == [gpu_check.NO_CUDA]
    assert not (tmp_path / "out").exists()


def test_the_default_run_fits_its_budget_by_its_own_estimate(tmp_path: Path) -> None:
    every = gpu_check.checks(_ctx(tmp_path))
    default = [every[i] for i in gpu_check.select(every, None, extra=False)]
    assert gpu_check.estimate(default) <= gpu_check.BUDGET_S <= gpu_check.LIMIT_S - 30 <= 8 * 60 - 30
    # the order: speed first, then correctness, then recipes; every group once, contiguous
    groups = [c.group for c in default]
    assert groups[0] == "speed" and groups.index("ops") < groups.index("recipes") < groups.index("pytest")
    assert [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]] == ["speed", "ops", "recipes", "pytest"]
    # the estimate counts every check and a worker start per group
    assert gpu_check.estimate(default) == sum(c.seconds for c in default) + 4 * gpu_check.WORKER_START_S
    extra = [c for c in every if c.extra]
    assert {c.name for c in extra} >= {"recipes/lm.py bf16-mixed compiled", "recipes/lm.py bf16-mixed FSDP2 x2"}


def test_dry_run_prints_the_plan_and_its_estimate(tmp_path: Path) -> None:
    out = _run("--dry-run", "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    every = gpu_check.checks(_ctx(tmp_path))
    default = [every[i] for i in gpu_check.select(every, None, extra=False)]
    for check in default:
        assert any(line.startswith(f"{check.group:10s} {check.name}") for line in lines), check.name
    assert "tokens 8192x1024 bfloat16" in out.stdout and "QK-norm (8*2048*16)x128 bfloat16" in out.stdout
    assert "half gradient to one ulp bfloat16" in out.stdout and "--trainer.precision 16-mixed" in out.stdout
    assert "compiled" not in out.stdout  # an --extra check
    assert lines[-1].startswith(f"{len(default)} checks in 4 workers, ~{gpu_check.estimate(default):.0f} s estimated")
    assert not (tmp_path / "out").exists() and "Traceback" not in out.stderr



def test_dry_run_extra_lists_the_compiled_and_multi_gpu_recipes(capsys: pytest.CaptureFixture) -> None:
    assert gpu_check.main(["--dry-run", "--extra"]) == 0
    text = capsys.readouterr().out
    assert "--model.compile true" in text and "--trainer.strategy fsdp2" in text and ", 2 GPUs" in text


def _rows(folder: Path) -> dict[str, dict]:
    with open(folder / "results.csv", newline="") as f:
        return {r["check"]: r for r in csv.DictReader(f)}


def test_groups_run_in_workers_and_a_dying_worker_costs_one_row(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(__import__("os").environ, **{gpu_check.CRASH_ENV: "ops/cpp bfloat16"})
    res = _run("--device", "cpu", "--only", "ops", "--match", r"^(cpp|half gradient to one ulp bfloat16)",
               "--out", str(out), env=env)
    rows = _rows(out)
    assert res.returncode == 1, res.stdout + res.stderr  # the crash is a failed row
    died = rows.pop("cpp bfloat16")
    assert died["status"] == "FAIL" and "the worker died (exit 134)" in died["result"]
    assert list(rows) == ["cpp float32", "cpp float16", "half gradient to one ulp bfloat16"]
    assert all(r["status"] == "PASS" for r in rows.values())
    table = (out / "results.md").read_text().splitlines()
    assert table[0].startswith("gpu_check on CPU") and len([t for t in table if t.startswith("| ")]) == 1 + 4
    assert res.stdout.strip().splitlines()[-2].startswith("4 checks: 3 PASS, 1 FAIL, 0 SKIP, 0 INFO")


def test_checks_past_the_budget_are_skipped_rows_that_say_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    status = gpu_check.main(["--device", "cpu", "--only", "ops", "--budget", "10", "--out", str(out)])
    rows = list(_rows(out).values())
    assert status == 0 and rows and all(r["status"] == "SKIP" and "time budget" in r["result"] for r in rows)


@pytest.mark.parametrize("returncode", [124, 139])
def test_a_worker_stopped_or_killed_leaves_a_fail_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       returncode: int) -> None:
    out = tmp_path / "out"
    gpu_check.start_output(out, "title")
    every = [gpu_check.Check("ops", f"check {i}", 1, lambda ctx: ("PASS", "", {})) for i in range(3)]
    calls = []

    def fake(cmd: list[str], timeout: float) -> tuple[int, str]:
        calls.append(cmd)
        return returncode, "Segmentation fault" if returncode == 139 else "timed out"

    monkeypatch.setattr(gpu_check, "_run_command", fake)
    args = gpu_check._parser().parse_args(["--device", "cpu", "--out", str(out)])
    gpu_check.run_group(args, every, [0, 1, 2], __import__("time").perf_counter(), budget=100)
    rows = list(_rows(out).values())
    if returncode == 124:  # the timeout: the group stops there
        assert [r["status"] for r in rows] == ["FAIL", "SKIP", "SKIP"] and "timed out" in rows[0]["result"]
        assert len(calls) == 1
    else:  # a crash: one FAIL row each, then a fresh worker for the rest
        assert [r["status"] for r in rows] == ["FAIL"] * 3 and "worker died (exit 139)" in rows[0]["result"]
        assert [c[c.index("--indices") + 1] for c in calls] == ["0,1,2", "1,2", "2"]


def test_a_wrong_kernel_fails_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gpu_check_ops.mrs_norm

    def off_by_a_percent(x: torch.Tensor, w: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return real(x, w, **kwargs) * 1.01

    monkeypatch.setattr(gpu_check_ops, "mrs_norm", off_by_a_percent)
    out = gpu_check_ops.check_backend_dtype("auto", torch.float32, "cpu", lambda layout: False)
    assert not out.ok and len(out.failed) == len(gpu_check_ops.LAYOUTS) and out.worst > 100
    assert gpu_check._outcome(out, len(gpu_check_ops.LAYOUTS))[0] == "FAIL"


def test_the_half_gradient_check_catches_a_backward_missing_its_second_term(monkeypatch: pytest.MonkeyPatch) -> None:
    for layout in gpu_check_ops.HALF_LAYOUTS:
        assert gpu_check_ops.half_gradient_error("auto", layout, torch.bfloat16, "cpu") <= 1.0, layout

    def first_term_only(x: torch.Tensor, w: torch.Tensor, channel_dim: int, spatial: bool,
                        backend: str) -> torch.Tensor:
        # the right output, but S held constant in the backward: dx = w g / S only
        y = gpu_check_ops.reference(x.detach(), w, channel_dim, spatial)
        return (x * (y / x.detach()).to(x.dtype))

    monkeypatch.setattr(gpu_check_ops, "mrs_norm", first_term_only)
    assert gpu_check_ops.half_gradient_error("auto", "tokens", torch.bfloat16, "cpu") > 10
    # ... which the loose bfloat16 tolerance of the ops check lets through
    assert gpu_check_ops.check_layout(lambda a, b: first_term_only(a, b, -1, False, "auto"), "tokens",
                                      torch.bfloat16, "cpu") <= 1.0


def test_an_unexpected_refusal_fails_and_an_expected_one_does_not() -> None:
    layouts = ["nchw_per_position", "tokens"]  # the cpp kernels refuse NCHW per position
    strict = gpu_check_ops.check_backend_dtype("cpp", torch.float32, "cpu", lambda layout: False, layouts)
    lenient = gpu_check_ops.check_backend_dtype("cpp", torch.float32, "cpu", lambda layout: True, layouts)
    assert not strict.ok and "nchw_per_position" in strict.failed[0]
    assert lenient.ok and lenient.refused == ["nchw_per_position"]


def test_the_reference_is_the_formula_of_the_method() -> None:
    x = torch.tensor([[3.0, 4.0, 0.0, 1.0]], dtype=torch.float64)  # phasor magnitudes 5 and 1: S = 3
    torch.testing.assert_close(gpu_check_ops.reference(x, None, -1, False, eps=0.0), x / 3)


def test_the_speed_row_says_which_is_faster_and_its_share_of_a_copy() -> None:
    row = gpu_check_speed.SpeedRow("tokens", "bfloat16", ours_fwd=1.0, ours_bwd=2.0, liger_fwd=1.5, liger_bwd=3.0)
    assert row.ratio == pytest.approx(2 / 3) and row.faster == "MRSNorm" and "x0.67, MRSNorm faster" in row.summary()
    slower = gpu_check_speed.SpeedRow("tokens", "bfloat16", 2.0, 2.0, 1.0, 1.0)
    assert slower.faster == "Liger RMSNorm" and gpu_check_speed.SpeedRow("t", "f", 1.0, 1.0).faster == ""
    case = gpu_check_speed.SpeedCase("tokens 64x256", (64, 256), "float32")
    res = gpu_check_speed.run_case(case, "cpu", copy_bw=1e9)
    assert res.ours_fwd > 0 and res.ours_bwd > 0 and res.module_ours > 0 and res.module_rms > 0
    assert res.bandwidth == pytest.approx(5 * 64 * 256 * 4 / (res.ours * 1e-3))
    assert res.copy_share == pytest.approx(res.bandwidth / 1e9) and res.liger is None and "Liger: CUDA only" in res.notes


def test_the_compiled_lm_row_asks_for_compile_in_a_run_folder_of_its_own(tmp_path: Path) -> None:
    plain, _ = gpu_check.recipe_command("recipes/lm.py", "bf16-mixed", "cuda", 1, None, tmp_path)
    compiled, _ = gpu_check.recipe_command("recipes/lm.py", "bf16-mixed", "cuda", 1, None, tmp_path, compiled=True)
    assert compiled[-2:] == ["--model.compile", "true"] and "--model.compile" not in plain
    folder = compiled.index("--trainer.default_root_dir") + 1
    assert compiled[folder] != plain[plain.index("--trainer.default_root_dir") + 1]
    _, notes = gpu_check.recipe_command("recipes/lm.py", "bf16-mixed", "cuda", 1, None, tmp_path,
                                        {"--trainer.precision"}, compiled=True)
    assert any(note.startswith("its --help lacks") and "--model.compile" in note for note in notes)


def _help_flags(script: str) -> set[str]:
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    return set(__import__("re").findall(r"(--[A-Za-z_][\w.]*)", out.stdout))


@pytest.mark.slow  # two recipe --help runs: ~10 s each
@pytest.mark.parametrize("script", ["recipes/cifar100.py", "recipes/lm.py"])
def test_every_recipe_flag_exists_in_the_recipes_help(script: str, tmp_path: Path) -> None:
    flags = _help_flags(script)
    assert "--trainer.precision" in flags  # the help was read
    for check in gpu_check.checks(gpu_check.Context("cuda", 2, 1, tmp_path, ["auto"])):
        if check.command and check.command[1] == script:
            unknown = [a for a in check.command if a.startswith("--") and a not in flags]
            assert not unknown, (check.name, unknown)


@pytest.mark.slow
def test_the_recipe_and_pytest_checks_run_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    status = gpu_check.main(["--device", "cpu", "--only", "recipes", "pytest", "--extra", "--budget", "1500",
                             "--out", str(out)])
    rows = _rows(out)
    assert status == 0, rows
    for name in ("recipes/cifar100.py 16-mixed", "recipes/lm.py bf16-mixed", "recipes/lm.py bf16-mixed compiled"):
        assert rows[name]["status"] == "PASS", rows[name]
    assert rows["pytest -m cuda"]["status"] == "SKIP"  # every CUDA test skips here


def _gone(pid: int, within: float = 10.0) -> bool:
    import os
    import time

    deadline = time.time() + within
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_timeout_stops_the_worker_and_the_command_it_started(tmp_path: Path) -> None:
    import gpu_check_recipes

    pidfile = tmp_path / "pid"
    sleeper = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    # a worker-like process: runs the sleeper in a session of its own, stops it on SIGTERM
    worker = ("import os, signal, sys; sys.path.insert(0, 'benchmarks'); import gpu_check_recipes as r; "
              "signal.signal(signal.SIGTERM, lambda *a: (r.kill_active(), os._exit(143))); "
              f"r.run_command([sys.executable, '-c', {sleeper!r}], 300)")
    t0 = __import__("time").time()
    status, text = gpu_check_recipes.run_command([sys.executable, "-c", worker], timeout=8)
    assert status == 124 and "timed out after 8 s" in text and __import__("time").time() - t0 < 25
    assert pidfile.exists(), "the sleeper never started"
    assert _gone(int(pidfile.read_text())), "the worker's command outlived its timeout"
