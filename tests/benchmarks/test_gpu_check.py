"""``benchmarks/gpu_check.py`` on a machine without a GPU: the missing-package lines and status 2,
the core's estimate (<= 240 s) and the ``--extended`` split, a check whose need is missing as a
SKIP row, the result file (JSON + Markdown) written by real CPU runs and read back, a run killed
mid-way leaving a valid file with its finished rows, a dying worker costing one row, the checks
catching a wrong kernel, the speed figures and the bar from measured numbers, and the recipe
commands against the recipes' own ``--help``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lightning_mrs.ops
from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402 - the benchmark under test
import gpu_check_ops  # noqa: E402
import gpu_check_results as results  # noqa: E402
import gpu_check_speed  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


def _plan(tmp_path: Path, device: str = "cuda", gpus: int = 1) -> list[gpu_check.Check]:
    return gpu_check.checks(gpu_check.Context(device, gpus, 1, tmp_path))


def _table(md: str) -> list[dict]:
    """The rows of the Markdown table, by header."""
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split(" | ")]
    return [dict(zip(header, (c.strip() for c in ln[2:-2].split(" | ")))) for ln in lines[1:]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible: the check would run")
def test_without_cuda_the_missing_lines_and_status_2(tmp_path: Path) -> None:
    out = _run("--out", str(tmp_path / "out"))
    assert out.returncode == 2
    lines = out.stdout.strip().splitlines()
    assert lines and all(line.startswith("missing: ") for line in lines) and "missing: CUDA - no CUDA GPU" in out.stdout
    assert not (tmp_path / "out").exists() and "Traceback" not in out.stderr


def test_the_core_fits_240_s_in_its_order_and_the_rest_is_extended(tmp_path: Path) -> None:
    every = _plan(tmp_path)
    core = [c for c in every if not c.extended]
    assert gpu_check.estimate(core) <= gpu_check.CORE_LIMIT_S == 240
    assert gpu_check.estimate(core) == sum(c.seconds for c in core) + gpu_check.WORKER_START_S  # one worker
    groups = [c.group for c in core]  # speed, then the ops, then the recipes, each group contiguous
    assert [g for i, g in enumerate(groups) if i == 0 or g != groups[i - 1]] == ["speed", "ops", "recipes"]
    names = [c.name for c in core]
    assert names[0] == "device copy" and {"tokens 16384x4096 bfloat16", "tokens 8192x8192 bfloat16",
                                          "tokens 4096x4096 float32", "QK-norm (8*2048*16)x128 bfloat16",
                                          "decode 1x2048 bfloat16", "decode 1x4096 bfloat16"} <= set(names)
    assert [n for n in names if n.startswith("triton")] == ["triton float32", "triton bfloat16", "triton float16"]
    recipes = [c for c in core if c.group == "recipes"]
    assert [(c.command[1], c.command[c.command.index("--trainer.precision") + 1],
             c.command[c.command.index("--trainer.max_steps") + 1]) for c in recipes] == [
        ("recipes/cifar100.py", "16-mixed", "1"), ("recipes/lm.py", "bf16-mixed", "1")]
    extended = {c.name for c in every if c.extended}
    assert {"pytest -m cuda", "torch.compile bfloat16", "half gradient to one ulp float16",
            "recipes/lm.py bf16-mixed compiled, 6 steps", "recipes/lm.py bf16-mixed FSDP2 x2, 6 steps"} <= extended
    assert gpu_check.select(every, extended=False) == [i for i, c in enumerate(every) if not c.extended]


def test_dry_run_prints_the_plan_and_the_core_estimate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    core = [c for c in _plan(tmp_path / "out") if not c.extended]
    for check in core:
        assert f"core     {check.group:9s} {check.name}" in text, check.name
    assert "extended" not in text and "--trainer.precision 16-mixed" in text
    assert text.strip().splitlines()[-1] == (f"core: {len(core)} checks, ~{gpu_check.estimate(core):.0f} s "
                                             f"estimated (limit 240 s)")
    assert gpu_check.main(["--dry-run", "--extended"]) == 0
    text = capsys.readouterr().out
    assert "extended pytest    pytest -m cuda" in text and "--model.compile true" in text and ", 2 GPUs" in text
    assert text.strip().splitlines()[-1].startswith("extended: ")
    assert not (tmp_path / "out").exists()


def test_what_is_missing_is_one_line_each_and_its_checks_are_skip_rows(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec answers None: not installed
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    missing = gpu_check.preflight("cuda")
    assert set(missing) == {"triton", "liger", "bf16"}
    assert all(line.startswith("missing: ") and "\n" not in line for line in missing.values())
    assert "triton" in missing["triton"] and "liger-kernel" in missing["liger"] and "7.5" in missing["bf16"]
    # the checks that need what is missing are SKIP rows that say why; nothing is run for them
    out = tmp_path / "out"
    results.start(out, {})
    every = _plan(out)
    pick = [i for i, c in enumerate(every) if c.name in ("device copy", "triton float32", "decode 1x2048 bfloat16",
                                                          "recipes/lm.py bf16-mixed, 1 step")]
    monkeypatch.setattr(gpu_check, "_run_command", lambda *a, **k: pytest.fail("ran a check it cannot run"))
    args = gpu_check._parser().parse_args(["--out", str(out)])
    gpu_check.run_checks(args, gpu_check.Context(args.device, 1, 1, out), every, pick, missing, time.perf_counter() + 100)
    rows = results.load(out)["rows"]
    assert [r["status"] for r in rows] == ["SKIP"] * 4
    assert [r["result"] for r in rows] == [missing["triton"], missing["bf16"], missing["triton"], missing["bf16"]]


def test_a_machine_without_a_c_compiler_cannot_run_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    line = gpu_check.preflight("cpu")["triton"]
    assert line.startswith("missing: a C compiler") and "Triton" in line
    monkeypatch.setenv("CC", "/usr/bin/cc")  # triton's own build takes $CC first
    assert "triton" not in gpu_check.preflight("cpu")


def test_the_missing_lines_come_first_without_importing_triton_liger_or_the_package() -> None:
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import gpu_check; gpu_check.preflight('cpu'); "
            "print([m for m in ('triton', 'liger_kernel', 'lightning', 'lightning_mrs') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


MATCH = r"^(device copy|tokens 8192x1024 bfloat16|decode 1x2048 bfloat16|cpp float32)$"


def test_the_result_file_is_written_row_by_row_and_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    assert gpu_check.main(["--device", "cpu", "--match", MATCH, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = results.load(out)
    rows = data["rows"]
    assert [r["check"] for r in rows] == ["device copy", "tokens 8192x1024 bfloat16", "decode 1x2048 bfloat16",
                                          "cpp float32"]
    assert [r["status"] for r in rows] == ["INFO", "INFO", "INFO", "PASS"]
    assert data["meta"]["missing"][-1].startswith("missing: CUDA - --device cpu")
    assert "measured" in data["summary"]["core"]
    # the speed columns are the measured times: GB/s, the share of the copy, the ratio to nn.RMSNorm
    copy, tokens, decode = rows[0], rows[1], rows[2]
    raw = tokens["raw"]
    assert raw["shape"] == [8192 // 64, 1024] and raw["nbytes"] == 128 * 1024 * 2
    assert tokens["fwd_gbs"] == pytest.approx(2 * raw["nbytes"] / (raw["ours_fwd"] * 1e-3) / 1e9)
    assert tokens["bwd_gbs"] == pytest.approx(3 * raw["nbytes"] / (raw["ours_bwd"] * 1e-3) / 1e9)
    assert tokens["fwd_copy"] == pytest.approx(tokens["fwd_gbs"] / copy["copy_gbs"])
    assert tokens["bwd_vs_torch"] == pytest.approx(raw["rms_bwd"] / raw["mrs_bwd"])
    assert tokens["fwd_vs_liger"] is None and "backward floor near 0.3 ms" in tokens["result"]
    assert decode["fwd_vs_torch"] == pytest.approx(decode["rms_ms"] / decode["mrs_ms"])
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    assert f"MRSNorm ran the {lightning_mrs.ops.which_backend(x)} backend" in decode["result"]
    # the Markdown table is the same rows, the figures rounded
    md = (out / "results.md").read_text()
    table = _table(md)
    assert [(t["check"], t["status"]) for t in table] == [(r["check"], r["status"]) for r in rows]
    assert table[1]["fwd % copy"] == f"{tokens['fwd_copy']:.0%}" and table[1]["fwd x Liger"] == ""
    assert table[1]["bwd x nn.RMSNorm"] == f"x{tokens['bwd_vs_torch']:.2f}"
    assert md.startswith("# gpu_check on CPU") and "missing: CUDA" in md and "QuACK RMSNorm" in md
    assert "- forward >= 85% of the copy on tokens 16384x4096 bfloat16: unknown (not measured)" in md
    assert printed.splitlines()[0].startswith("missing: ") and "bar: backward >= 1.0x Liger" in printed
    assert not list(out.glob(".*.tmp"))


def test_the_bar_is_judged_on_measured_figures() -> None:
    copy_bw = gpu_check_speed.copy_bandwidth("cpu", nbytes=1 << 22)
    rows = []
    for name, dtype in results.BAR_CASES:
        case = next(c for c in gpu_check_speed.CASES if (c.name, c.dtype) == (name, dtype))
        row = gpu_check_speed.run_case(case, "cpu", copy_bw, scale=1024)
        row.liger_bwd = row.rms_bwd  # a measured time in Liger's place (Liger runs on CUDA only)
        rows.append({"group": "speed", "check": f"{name} {dtype}", **row.figures()})
    verdicts = results.bar(rows)
    assert len(verdicts) == 6
    for (claim, met, shown), (row, (key, floor)) in zip(verdicts, [(r, k) for r in rows for k in (
            ("ours_fwd", 0.85), ("liger", 1.0), ("ours_bwd", 0.60))]):
        raw = row["raw"]
        if key == "ours_fwd":  # independently: the bytes over the time over the copy's bandwidth
            value = 2 * raw["nbytes"] / (raw["ours_fwd"] * 1e-3) / copy_bw
        elif key == "ours_bwd":
            value = 3 * raw["nbytes"] / (raw["ours_bwd"] * 1e-3) / copy_bw
        else:
            value = raw["liger_bwd"] / raw["ours_bwd"]
        assert met == (value >= floor), (claim, value)
        assert claim.endswith(row["check"])
    assert all(met is None and shown == "not measured" for _, met, shown in results.bar(rows[:1])[3:])


@pytest.mark.slow  # two processes importing torch, then rows: ~25 s here
def test_a_run_killed_mid_way_leaves_a_valid_file_with_its_finished_rows(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--match", "QK-norm|tokens|decode",
                             "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if (out / "results.json").exists() and len(results.load(out)["rows"]) >= 2:
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its worker, mid-way
        proc.wait()
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    total = len([c for c in _plan(out, "cpu") if c.group == "speed" and c.name != "device copy"])
    assert 2 <= len(rows) < total, "the run was not cut off mid-way"
    assert all(r["status"] == "INFO" and (r.get("fwd_gbs") or r.get("mrs_ms")) > 0 for r in rows), rows
    table = _table((out / "results.md").read_text())
    assert len(table) >= len(rows) - 1  # the Markdown follows the JSON, at most the row being written behind
    assert [t["check"] for t in table] == [r["check"] for r in rows][:len(table)]


@pytest.mark.slow  # two worker starts: ~35 s here
def test_checks_run_in_workers_and_a_dying_worker_costs_one_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    monkeypatch.setenv(gpu_check.CRASH_ENV, "ops/cpp bfloat16")  # the worker subprocess dies at that check
    assert gpu_check.main(["--device", "cpu", "--match", r"^cpp", "--out", str(out)]) == 1  # a failed row
    rows = {r["check"]: r for r in results.load(out)["rows"]}
    died = rows.pop("cpp bfloat16")
    assert died["status"] == "FAIL" and "the worker died (exit 134)" in died["result"]
    assert list(rows) == ["cpp float32", "cpp float16"] and all(r["status"] == "PASS" for r in rows.values())
    assert "3 rows: 2 PASS, 1 FAIL, 0 SKIP, 0 INFO" in capsys.readouterr().out


def test_checks_past_the_budget_are_skip_rows_that_say_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert gpu_check.main(["--device", "cpu", "--match", "^cpp", "--budget", "10", "--out", str(out)]) == 0
    rows = results.load(out)["rows"]
    assert len(rows) == 3 and all(r["status"] == "SKIP" and "time budget" in r["result"] for r in rows)


def test_the_extended_checks_run_only_after_a_core_without_a_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    ran = []

    def fake(cmd: list[str], timeout: float, live: bool = False) -> tuple[int, str]:
        indices = [int(i) for i in cmd[cmd.index("--indices") + 1].split(",")]
        every = _plan(tmp_path / "out", "cpu")
        for i in indices:  # write the rows a worker would: the core's first check fails
            ran.append(i)
            gpu_check.report(tmp_path / "out", i, every[i], "FAIL" if i == indices[0] and not every[i].extended
                             else "PASS", 0.0, "")
        return 0, ""

    monkeypatch.setattr(gpu_check, "_run_command", fake)
    match = "^(cpp float32|eager bfloat16)$"
    assert gpu_check.main(["--device", "cpu", "--extended", "--match", match, "--out", str(tmp_path / "out")]) == 1
    assert [r["check"] for r in results.load(tmp_path / "out")["rows"]] == ["cpp float32"]
    assert "extended: not run: the core has 1 FAIL row(s)" in capsys.readouterr().out
    monkeypatch.setattr(gpu_check, "_run_command", lambda cmd, timeout, live=False: (
        [gpu_check.report(tmp_path / "ok", int(i), _plan(tmp_path / "ok", "cpu")[int(i)], "PASS", 0.0, "")
         for i in cmd[cmd.index("--indices") + 1].split(",")], (0, ""))[1])
    assert gpu_check.main(["--device", "cpu", "--extended", "--match", match, "--out", str(tmp_path / "ok")]) == 0
    rows = results.load(tmp_path / "ok")["rows"]
    assert [(r["check"], r["extended"]) for r in rows] == [("cpp float32", False), ("eager bfloat16", True)]


@pytest.mark.parametrize("returncode", [124, 139])
def test_a_worker_stopped_or_killed_leaves_a_fail_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       returncode: int) -> None:
    out = tmp_path / "out"
    results.start(out, {})
    every = [gpu_check.Check("ops", f"check {i}", 1, lambda ctx: ("PASS", "", {})) for i in range(3)]
    calls = []

    def fake(cmd: list[str], timeout: float, live: bool = False) -> tuple[int, str]:
        calls.append(cmd)
        return returncode, "Segmentation fault" if returncode == 139 else "timed out"

    monkeypatch.setattr(gpu_check, "_run_command", fake)
    args = gpu_check._parser().parse_args(["--device", "cpu", "--out", str(out)])
    gpu_check.run_checks(args, gpu_check.Context(args.device, 1, 1, out), every, [0, 1, 2], {}, time.perf_counter() + 100)
    rows = results.load(out)["rows"]
    assert [r["status"] for r in rows] == ["FAIL"] * 3  # one FAIL row each, then a fresh worker for the rest
    assert ("timed out" if returncode == 124 else "worker died (exit 139)") in rows[0]["result"]
    assert [c[c.index("--indices") + 1] for c in calls] == ["0,1,2", "1,2", "2"]


def test_after_a_cuda_error_the_rest_runs_in_a_fresh_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    results.start(out, {})

    def illegal_access(ctx: gpu_check.Context) -> tuple[str, str, dict]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    every = [gpu_check.Check("ops", "bad", 1, illegal_access),
             gpu_check.Check("ops", "next", 1, lambda ctx: ("PASS", "", {}))]
    monkeypatch.setattr(gpu_check, "checks", lambda ctx: every)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the worker's SIGTERM handler: not in pytest
    # the worker: the failing check's row, then it stops (its context is poisoned) before "next"
    assert gpu_check.run_worker(gpu_check.Context("cuda", 1, 1, out), [0, 1]) == gpu_check.RESTART
    assert [(r["check"], r["status"]) for r in results.load(out)["rows"]] == [("bad", "FAIL")]
    # the parent: no FAIL row for "next" (it never started), which runs in a fresh worker
    calls = []

    def fake(cmd: list[str], timeout: float, live: bool = False) -> tuple[int, str]:
        indices = [int(i) for i in cmd[cmd.index("--indices") + 1].split(",")]
        calls.append(indices)
        return gpu_check.run_worker(gpu_check.Context("cuda", 1, 1, out), indices), ""

    results.start(out, {})
    monkeypatch.setattr(gpu_check, "_run_command", fake)
    args = gpu_check._parser().parse_args(["--out", str(out)])
    gpu_check.run_checks(args, gpu_check.Context(args.device, 1, 1, out), every, [0, 1], {}, time.perf_counter() + 100)
    assert calls == [[0, 1], [1]]
    assert [(r["check"], r["status"]) for r in results.load(out)["rows"]] == [("bad", "FAIL"), ("next", "PASS")]


def test_a_wrong_kernel_fails_its_check(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gpu_check_ops.mrs_norm

    def off_by_a_percent(x: torch.Tensor, w: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return real(x, w, **kwargs) * 1.01

    monkeypatch.setattr(gpu_check_ops, "mrs_norm", off_by_a_percent)
    out = gpu_check_ops.check_backend_dtype("auto", torch.float32, "cpu", lambda layout: False)
    assert not out.ok and len(out.failed) == len(gpu_check_ops.LAYOUTS) and out.worst > 100
    assert out.row(len(gpu_check_ops.LAYOUTS))[0] == "FAIL"


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


def test_the_speed_row_figures_from_a_cpu_run() -> None:
    case = gpu_check_speed.SpeedCase("tokens 64x256", (64, 256), "float32")
    row = gpu_check_speed.run_case(case, "cpu", copy_bw=1e9)
    assert row.ours_fwd > 0 and row.ours_bwd > 0 and row.mrs_bwd > 0 and row.rms_fwd > 0
    figures = row.figures()
    assert figures["fwd_gbs"] == pytest.approx(2 * 64 * 256 * 4 / (row.ours_fwd * 1e-3) / 1e9)
    assert figures["bwd_copy"] == pytest.approx(3 * 64 * 256 * 4 / (row.ours_bwd * 1e-3) / 1e9)
    assert figures["fwd_vs_torch"] == pytest.approx(row.rms_fwd / row.mrs_fwd)
    assert figures["bwd_vs_liger"] is None and "Liger: CUDA only" in row.notes


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
    for check in _plan(tmp_path, gpus=2):
        if check.command and check.command[1] == script:
            unknown = [a for a in check.command if a.startswith("--") and a not in flags]
            assert not unknown, (check.name, unknown)


@pytest.mark.slow
def test_the_recipe_and_pytest_checks_run_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    status = gpu_check.main(["--device", "cpu", "--extended", "--match", "^recipes/(cifar100|lm)|^pytest",
                             "--budget", "3000", "--out", str(out)])
    rows = {r["check"]: r for r in results.load(out)["rows"]}
    assert status == 0, rows
    for name in ("recipes/cifar100.py 16-mixed, 1 step", "recipes/lm.py bf16-mixed, 1 step",
                 "recipes/lm.py bf16-mixed compiled, 6 steps"):
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
