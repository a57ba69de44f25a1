"""recipes/cifar100.py interrupted by Ctrl-C and resumed, as recipes/lm.py: a checkpoint at a step boundary, the
resume command, exit 130, and a resume in the middle of an epoch that ends bit for bit as the uninterrupted run
(the same order, augmentation and step seeds: recipes.vision.resume), whatever the DataLoader's worker count."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
import warnings

from helpers.lm import final_weights

# digits: 1,438 training images, 179 batches of 8 an epoch: the interruption comes in the middle of the first
ARGS = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "digits",
        "--data.image_size", "8", "--data.batch_size", "8", "--trainer.max_steps", "6",
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


def _interrupted_and_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture,
                             extra: tuple[str, ...] = (), sigint_at: int = 3, steps: int = 6) -> Path:
    from recipes.cifar100 import run

    root = tmp_path / "interrupted"
    args = [*ARGS, *extra, "--trainer.default_root_dir", str(root)]
    _sigint_after_step(monkeypatch, sigint_at)
    assert run(args) == 130
    err = capfd.readouterr().err
    saved = _last(root)
    # the step running when Ctrl-C came (4: the SIGINT arrived as step 3 ended) finishes, then the fit stops
    assert f"interrupted after step {sigint_at + 1}: saved {saved}; resume with" in err, err[-3000:]
    assert f"python recipes/cifar100.py {' '.join(args)} --ckpt_path {saved}" in err
    assert final_weights(saved)["step"] == sigint_at + 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works again afterwards
    monkeypatch.undo()
    monkeypatch.setattr(sys, "argv", ["cifar100.py"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run([*args, "--ckpt_path", str(saved)]) == 0
    assert not [w for w in caught if "not resumable" in str(w.message)]  # Lightning's mid-epoch warning
    assert final_weights(_last(root, 1))["step"] == steps
    return _last(root, 1)


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a)["state_dict"], final_weights(b)["state_dict"]
    assert wa.keys() == wb.keys()
    for name, tensor in wa.items():
        assert torch.equal(tensor, wb[name]), name


@pytest.mark.slow  # three fits; the default suite has the crash cell of test_resume_faults.py (same machinery)
def test_ctrl_c_saves_prints_the_resume_command_exits_130_and_resumes_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    from recipes.cifar100 import run

    reference = tmp_path / "uninterrupted"
    assert run([*ARGS, "--trainer.default_root_dir", str(reference)]) == 0
    resumed = _interrupted_and_resumed(tmp_path, monkeypatch, capfd)
    _assert_same_weights(_last(reference), resumed)
    # the check can fail: a step more or less of the same data changes the weights
    assert not torch.equal(final_weights(_last(reference))["state_dict"]["model.fc.weight"],
                           final_weights(_last(tmp_path / "interrupted"))["state_dict"]["model.fc.weight"])


@pytest.mark.slow  # worker processes start
def test_the_resume_with_dataloader_workers_ends_as_the_uninterrupted_run_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    from recipes.cifar100 import run

    reference = tmp_path / "uninterrupted"
    assert run([*ARGS, "--trainer.default_root_dir", str(reference)]) == 0
    resumed = _interrupted_and_resumed(tmp_path, monkeypatch, capfd, ("--data.num_workers", "2"))
    _assert_same_weights(_last(reference), resumed)


@pytest.mark.slow  # epochs of 5 batches, each validated
def test_a_resume_from_an_epochs_last_step_goes_on_bit_for_bit_into_the_next_epochs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    from recipes.cifar100 import run

    # saved at step 5, epoch 0's end; no monitor: last.ckpt follows every validation (not only a better top-1)
    short = ("--trainer.limit_train_batches", "5", "--trainer.max_steps", "12", "--checkpoint.monitor", "null")
    reference = tmp_path / "uninterrupted"
    assert run([*ARGS, *short, "--trainer.default_root_dir", str(reference)]) == 0
    resumed = _interrupted_and_resumed(tmp_path, monkeypatch, capfd, short, sigint_at=4, steps=12)
    _assert_same_weights(_last(reference), resumed)
