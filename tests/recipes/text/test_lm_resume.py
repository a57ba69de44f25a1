"""recipes/lm.py interrupted, crashed and resumed: the same result as a run never stopped, and one line per mistake.

Ctrl-C (a real SIGINT to the process, in-process so that the runs share nothing but the command line)
saves a checkpoint at a step boundary and exits 130; a crash in a step's forward saves ``crash.ckpt``;
resuming either ends with the weights, bit for bit, of the uninterrupted run. A checkpoint of another
model is one error line naming the options, the options that may change are named in one notice line
and do apply (the learning rate too, which the optimizer's saved state would otherwise keep).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from helpers import ROOT
from helpers.lm import TINY, LMRun, final_weights
from helpers.tensorboard import event_scalars, session_start

STEPS = ["--trainer.max_steps", "6"]


def _last(root: Path, version: int = 0) -> Path:
    return root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the tiny MRSNorm run, 6 steps, never stopped."""
    from recipes.lm import run

    root = tmp_path_factory.mktemp("uninterrupted")
    saved = sys.argv
    sys.argv = ["lm.py"]
    try:
        assert run([*TINY, *STEPS, "--trainer.default_root_dir", str(root)]) == 0
    finally:
        sys.argv = saved
    return root


@pytest.fixture(autouse=True)
def _argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lm.py"])


def _assert_same_run(reference: Path, resumed: Path) -> None:
    a, b = final_weights(reference), final_weights(resumed)
    assert a["step"] == b["step"] == 6
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name


def _sigint_after_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """A real Ctrl-C (SIGINT to this process) once the model's step ``step`` has ended."""
    from recipes.text.byte_lm import ByteLM

    original = ByteLM.on_train_batch_end

    def then_sigint(self, outputs, batch, batch_idx):  # noqa: ANN001
        original(self, outputs, batch, batch_idx)
        if self.trainer.global_step == step and not getattr(self, "_sigint_sent", False):
            self._sigint_sent = True
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ByteLM, "on_train_batch_end", then_sigint)


@pytest.fixture
def ctrl_c_works() -> Iterator[None]:
    """Python's own SIGINT handler, also when pytest runs as a background job (which starts with SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_saves_a_checkpoint_and_the_resumed_run_ends_as_the_uninterrupted_one(
        uninterrupted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lm: LMRun, ctrl_c_works: None) -> None:
    args = [*TINY, *STEPS, "--trainer.default_root_dir", str(tmp_path)]
    _sigint_after_step(monkeypatch, 3)
    status, out = lm(args)
    assert status == 130, out[-3000:]
    saved = _last(tmp_path)
    # the step running when Ctrl-C came (4: the SIGINT arrived as step 3 ended) finishes, then the fit stops
    assert f"interrupted after step 4: saved {saved}; resume with" in out, out[-3000:]
    assert f"--ckpt_path {saved}" in out
    assert final_weights(saved)["step"] == 4
    assert session_start(saved.parents[1])["ended"].string_value == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards
    monkeypatch.undo()
    monkeypatch.setattr(sys, "argv", ["lm.py"])

    status, out = lm([*args, "--ckpt_path", str(saved)])
    assert status == 0, out[-3000:]
    assert "fit: 2 steps (4 -> 6) in" in out  # the steps this fit ran, not the run's total
    assert "precision 32-true: activations ran in torch.float32" in out  # after a resume too
    assert "note: resuming" not in out  # the same options
    _assert_same_run(_last(uninterrupted), _last(tmp_path, 1))
    reference = event_scalars(uninterrupted / "lightning_logs" / "version_0")["val/bpb"][-1]
    assert event_scalars(tmp_path / "lightning_logs" / "version_1")["val/bpb"][-1] == reference


def test_a_crash_saves_what_resumes_to_the_same_result(uninterrupted: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       lm: LMRun) -> None:
    from recipes.text.byte_lm import ByteLM

    original = ByteLM.training_step

    def fails_at_step_3(self, batch, batch_idx):  # noqa: ANN001
        if self.trainer.global_step == 3:
            raise RuntimeError("a failure in the forward of step 4")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(ByteLM, "training_step", fails_at_step_3)
    args = [*TINY, *STEPS, "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(RuntimeError, match="a failure in the forward of step 4"):
        lm(args)
    out = lm.output
    crash = _last(tmp_path).with_name("crash.ckpt")
    assert f"failed after step 3: saved {crash}; resume with" in out, out[-3000:]
    monkeypatch.undo()
    monkeypatch.setattr(sys, "argv", ["lm.py"])
    status, out = lm([*args, "--ckpt_path", str(crash)])
    assert status == 0, out[-3000:]
    _assert_same_run(_last(uninterrupted), _last(tmp_path, 1))


def test_resuming_a_finished_run_says_so_with_the_checkpoints_val_bpb(uninterrupted: Path, tmp_path: Path,
                                                                     lm: LMRun) -> None:
    status, out = lm([*TINY, *STEPS, "--trainer.default_root_dir", str(tmp_path),
                          "--ckpt_path", str(_last(uninterrupted))])
    assert status == 0, out[-3000:]
    bpb = event_scalars(uninterrupted / "lightning_logs" / "version_0")["val/bpb"][-1][1]
    assert (f"fit: nothing to train: the checkpoint is at step 6 and --trainer.max_steps is 6 (raise it to train "
            f"on); val/bpb {bpb:.3f} at step 6 (the checkpoint's)") in out, out[-2000:]


@pytest.mark.parametrize("args, named", [
    (["--model.norm", "rms", "--data.seq_len", "64", "--model.lr", "0.1"],
     "the checkpoint was trained with --model.norm 'mrs' (this run: 'rms'), --data.seq_len 32 (this run: 64), which "
     "define the model"),
    (["--model.config", '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2}'], "--model.config {"),
    (["--model.arch", "qwen3"], "--model.arch 'llama' (this run: 'qwen3')"),
])
def test_a_checkpoint_of_another_model_is_one_line(uninterrupted: Path, tmp_path: Path, args: list[str], named: str,
                                                   lm_error: Callable[[list[str]], str]) -> None:
    ckpt = _last(uninterrupted)
    line = lm_error([*TINY, *STEPS, "--trainer.default_root_dir", str(tmp_path / "run"), *args, "--ckpt_path",
                     str(ckpt)])
    assert line.startswith(f"error: --ckpt_path {ckpt}: ") and named in line, line
    assert not (tmp_path / "run").exists()  # nothing written: the corrected command starts clean


def test_the_options_that_may_change_are_named_once_and_apply(uninterrupted: Path, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from recipes.lm import build_cli

    ckpt = _last(uninterrupted)
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    cli = build_cli([*TINY, "--trainer.max_steps", "8", "--model.lr", "0.1", "--data.batch_size", "8",
                     "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(ckpt)])
    out = caplog.text
    notes = [m for m in caplog.messages if m.startswith("note: resuming")]
    assert notes == [f"note: resuming {ckpt} with options that differ from the checkpoint's, from its step on: "
                     "--model.lr 0.001 -> 0.1, --data.batch_size 4 -> 8, --trainer.max_steps 6 -> 8"], out[-2000:]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(ckpt))
    optimizer, scheduler = cli.trainer.optimizers[0], cli.trainer.lr_scheduler_configs[0].scheduler
    # the optimizer's saved state said lr 0.001; this run's 0.1 is what trained, on the 8-step schedule
    assert [g["initial_lr"] for g in optimizer.param_groups] == [0.1, 0.1] and scheduler.base_lrs == [0.1, 0.1]
    factor = scheduler.lr_lambdas[0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * factor(scheduler.last_epoch), rel=1e-12)
    assert factor(8) == pytest.approx(0.0) and 0.0 < factor(6) < 1.0  # cosine to 0 at step 8, not 6
    assert cli.trainer.global_step == 8 and cli.datamodule.batch_size == 8


@pytest.mark.parametrize("signum, status, what", [
    (signal.SIGINT, 130, "interrupted"),
    pytest.param(signal.SIGTERM, 143, "stopped by SIGTERM", marks=pytest.mark.slow),  # about 30 s: the script
], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_through_the_script_exits_130_with_the_resume_command(tmp_path: Path, signum: int, status: int,
                                                                    what: str) -> None:
    """SIGINT to the real script, as a terminal's Ctrl-C: the line that resumes, exit 130, the checkpoint; SIGTERM
    (a scheduler's preemption) the same with exit 143, where Lightning alone would train on (an endless epoch)."""
    import subprocess

    args = [*TINY, "--trainer.max_steps", "100000", "--trainer.val_check_interval", "100000",
            "--trainer.default_root_dir", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "recipes" / "lm.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # the precision line comes after the first step
        lines.append(line)
        if line.startswith("precision "):
            break
    proc.send_signal(signum)
    rest, _ = proc.communicate(timeout=240)
    out = "".join(lines) + rest
    assert proc.returncode == status, out[-3000:]
    saved = _last(tmp_path)
    step = final_weights(saved)["step"]
    assert step >= 1 and f"{what} after step {step}: saved {saved}; resume with" in out, out[-3000:]
    command = out.split("resume with", 1)[1].strip().splitlines()[0]
    assert command.startswith("python recipes/lm.py --model.config ") and command.endswith(f"--ckpt_path {saved}")
    assert "Traceback" not in out


@pytest.mark.slow  # three fits (~15 s)
def test_precision_line_with_gradient_accumulation(tmp_path: Path, lm: LMRun) -> None:
    status, out = lm([*TINY, "--trainer.accumulate_grad_batches", "2", "--trainer.default_root_dir",
                          str(tmp_path)])
    assert status == 0, out[-3000:]
    assert "precision 32-true: activations ran in torch.float32 (Precision, no loss scaler)" in out
    assert math.isfinite(event_scalars(tmp_path / "lightning_logs" / "version_0")["val/bpb"][-1][1])
    assert "fit: 3 steps in" in out


@pytest.mark.parametrize("precision, dtype", [("32-true", "torch.float32"), ("16-mixed", "torch.float16")])
def test_precision_line_names_gpt2s_activations(tmp_path: Path, lm: LMRun, precision: str, dtype: str) -> None:
    """GPT-2's projections are transformers' ``Conv1D``, not ``nn.Linear``: their dtype is the activations'."""
    status, out = lm([*TINY, "--model.norm", "none", "--model.arch", "gpt2", "--model.config",
                          '{"n_layer": 2, "n_embd": 32, "n_head": 2}', "--trainer.max_steps", "1",
                          "--trainer.precision", precision, "--trainer.default_root_dir", str(tmp_path)])
    assert status == 0, out[-3000:]
    assert f"precision {precision}: activations ran in {dtype}" in out, out[-3000:]


def test_resume_hint_without_a_checkpoint_names_the_last_one() -> None:
    from recipes.common.interrupt import SaveOnInterrupt

    saver = SaveOnInterrupt()
    saver.step, saver.unsaved_reason = 7, "a multi-process run cannot save once one process has failed"
    assert saver.resume_hint("recipes/lm.py", ["--model.lr", "0.1"], last="run/last.ckpt") == (
        "stopped at step 7 without a checkpoint (a multi-process run cannot save once one process has failed); "
        "the last checkpoint is run/last.ckpt; resume with\n  python recipes/lm.py --model.lr 0.1 --ckpt_path "
        "run/last.ckpt")


def test_a_sharded_checkpoint_is_checked_by_its_metadata(tmp_path: Path) -> None:
    """FSDP2 writes a directory of shards with ``meta.pt`` (the hyperparameters, the callbacks' states)."""
    from recipes.common.checkpoints import check_resume
    from recipes.common.errors import UsageError
    from recipes.lm import RESUME

    sharded = tmp_path / "last.ckpt"
    sharded.mkdir()
    with pytest.raises(UsageError, match=r"a directory without meta.pt, so not the checkpoint of a sharded run"):
        check_resume(str(sharded), torch.nn.Linear(1, 1), RESUME, {"--model.norm": "mrs"})
    torch.save({"hyper_parameters": {"norm": "none", "lr": 0.003}, "callbacks": {}}, sharded / "meta.pt")
    with pytest.raises(UsageError, match=r"trained with --model.norm 'none' \(this run: 'mrs'\), which define"):
        check_resume(str(sharded), torch.nn.Linear(1, 1), RESUME, {"--model.norm": "mrs"})
    notice = check_resume(str(sharded), torch.nn.Linear(1, 1), RESUME, {"--model.norm": "none", "--model.lr": 0.01})
    assert notice == (f"note: resuming {sharded} with options that differ from the checkpoint's, from its step on: "
                      "--model.lr 0.003 -> 0.01")


def test_an_eager_checkpoint_resumes_compiled(uninterrupted: Path, tmp_path: Path, lm: LMRun) -> None:
    """``--model.compile`` may change on resume: named in the notice, and the compiled steps continue the eager
    run as the eager steps would (Inductor's rounding apart)."""
    ckpt = _last(uninterrupted)
    ends = {}
    for compiled in ("false", "true"):
        root = tmp_path / compiled
        status, out = lm([*TINY, "--trainer.max_steps", "8", "--model.compile", compiled,
                          "--trainer.default_root_dir", str(root), "--ckpt_path", str(ckpt)])
        assert status == 0, out[-3000:]
        assert "fit: 2 steps (6 -> 8) in" in out
        assert ("torch.compile: 2 decoder layers (LlamaDecoderLayer), each in place" in out) == (compiled == "true")
        ends[compiled] = final_weights(_last(root))
    assert "--model.compile False -> True" in out, out[-3000:]
    eager, compiled = ends["false"]["state_dict"], ends["true"]["state_dict"]
    assert eager.keys() == compiled.keys() and ends["true"]["step"] == 8
    for name, tensor in eager.items():
        torch.testing.assert_close(compiled[name], tensor, rtol=1e-3, atol=1e-5, msg=name)
