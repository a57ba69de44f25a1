"""recipes/cifar100.py interrupted by Ctrl-C and resumed, as recipes/lm.py: a checkpoint at a step boundary, the
resume command, exit 130, and a resume that runs to the end. Not yet bit for bit (the strict xfail below): the
image data's shuffled order and random augmentation are not resumable in the middle of an epoch (Lightning warns
on such a resume), where the LM recipe's step-indexed windows are."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from helpers.lm import final_weights

ARGS = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "digits",
        "--data.image_size", "16", "--data.batch_size", "32", "--trainer.max_steps", "6",
        "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false"]


def _last(root: Path, version: int = 0) -> Path:
    return root / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


@pytest.fixture(autouse=True)
def _argv(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sys, "argv", ["cifar100.py"])
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # also under a background pytest
    yield
    signal.signal(signal.SIGINT, before)


def _sigint_after_step(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """A real Ctrl-C (SIGINT to this process) once the model's step ``step`` has ended."""
    from recipes.vision.classifier import ImageClassifier

    original = ImageClassifier.on_train_batch_end

    def then_sigint(self, outputs, batch, batch_idx):  # noqa: ANN001
        original(self, outputs, batch, batch_idx)
        if self.trainer.global_step == step and not getattr(self, "_sigint_sent", False):
            self._sigint_sent = True
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ImageClassifier, "on_train_batch_end", then_sigint)


def _interrupted_and_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> Path:
    from recipes.cifar100 import run

    root = tmp_path / "interrupted"
    args = [*ARGS, "--trainer.default_root_dir", str(root)]
    _sigint_after_step(monkeypatch, 3)
    assert run(args) == 130
    err = capfd.readouterr().err
    saved = _last(root)
    # the step running when Ctrl-C came (4: the SIGINT arrived as step 3 ended) finishes, then the fit stops
    assert f"interrupted after step 4: saved {saved}; resume with" in err, err[-3000:]
    assert f"python recipes/cifar100.py {' '.join(args)} --ckpt_path {saved}" in err
    assert final_weights(saved)["step"] == 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards
    monkeypatch.undo()
    monkeypatch.setattr(sys, "argv", ["cifar100.py"])
    assert run([*args, "--ckpt_path", str(saved)]) == 0
    assert final_weights(_last(root, 1))["step"] == 6
    return _last(root, 1)


def test_ctrl_c_saves_prints_the_resume_command_exits_130_and_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    _interrupted_and_resumed(tmp_path, monkeypatch, capfd)


@pytest.mark.slow  # two runs more; documents the gap, see the module docstring
@pytest.mark.xfail(strict=True, reason="the image data's order and augmentation do not resume mid-epoch")
def test_the_resumed_run_ends_bit_for_bit_as_the_uninterrupted_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    from recipes.cifar100 import run

    reference = tmp_path / "uninterrupted"
    assert run([*ARGS, "--trainer.default_root_dir", str(reference)]) == 0
    resumed = _interrupted_and_resumed(tmp_path, monkeypatch, capfd)
    a, b = final_weights(_last(reference)), final_weights(resumed)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
