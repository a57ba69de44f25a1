"""A run stopped, then resumed with another ``--data.batch_size`` or ``--data.num_workers`` (issue 61, cases 4 and 5).

* Another worker count (0 -> 2, 2 -> 0; the default differs between CPU and GPU machines), both recipes: the
  resumed run trains the batches (data and seeds) the uninterrupted run trained and ends with its weights, bit for
  bit. Before, the image recipe crashed in torchdata (``AssertionError`` under Lightning's "Please call
  iter(combined_loader) first.") and the LM recipe drew its windows from other per-worker streams.
* Another batch size, image recipe (the LM recipe's note: tests/recipes/text/test_lm_resume.py): one note line says
  what changes, and the resumed epoch trains every image the epoch had left, in the uninterrupted order and
  augmentation (images are seeded per index: the same image is the same tensor in a batch of 8 or 16). Before,
  8 -> 16 ended the epoch early, without a word.

Records: each training step appends ``rank step batch_idx sha1(batch) seed`` (:mod:`helpers.faults`); the image
test also keeps each image's digest, in the order trained.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from helpers.faults import inject, last_checkpoint, read_record, recipe
from helpers.lm import TINY, final_weights

VISION = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "digits",
          "--data.image_size", "8", "--data.batch_size", "8", "--trainer.max_steps", "6",
          "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
LM = [*TINY, "--trainer.max_steps", "6", "--export", "none"]
ARGS = {"cifar100": VISION, "lm": LM}
AT = 3  # Ctrl-C comes inside optimizer step 3 (0-based): the step ends, last.ckpt holds step 4


pytestmark = pytest.mark.usefixtures("python_sigint")


def _digests(images: torch.Tensor) -> list[str]:
    return [hashlib.sha1(image.contiguous().numpy().tobytes()).hexdigest()[:16] for image in images]


def _fit(name: str, args: list[str], record: Path, fault: Optional[str] = None, at: int = AT,
         images: Optional[list[str]] = None) -> int:
    """The recipe's ``run(args)`` in-process, recording each step (and, given ``images``, each image trained)."""
    from recipes.common.training import ValidateAtEnd

    run, module = recipe(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [f"{name}.py"])
        inject(module, ValidateAtEnd, fault, at, str(record), mp.setattr)
        if images is not None:
            recorded = module.training_step

            def keep_images(self, batch, batch_idx):  # noqa: ANN001
                out = recorded(self, batch, batch_idx)
                images.extend(_digests(batch[0]))
                return out

            mp.setattr(module, "training_step", keep_images)
        return run(args)


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa["step"] == wb["step"]
    assert wa["state_dict"].keys() == wb["state_dict"].keys()
    for key, tensor in wa["state_dict"].items():
        assert torch.equal(tensor, wb["state_dict"][key]), key


_REFERENCES: dict[str, tuple[Path, list[str]]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """``reference(name)``: the uninterrupted run (no DataLoader workers): its last checkpoint and its record."""

    def get(name: str) -> tuple[Path, list[str]]:
        if name not in _REFERENCES:
            root = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            args = [*ARGS[name], "--data.num_workers", "0", "--trainer.default_root_dir", str(root)]
            assert _fit(name, args, root / "record.txt") == 0
            _REFERENCES[name] = (last_checkpoint(root, 0), read_record(root / "record.txt"))
        return _REFERENCES[name]

    yield get
    _REFERENCES.clear()


CHANGES = [pytest.param(name, before, after, marks=() if (before, after) == (0, 2) else pytest.mark.slow,
                        id=f"{name}-{before}-to-{after}") for name in ("cifar100", "lm") for before, after in
           ((0, 2), (2, 0))]


@pytest.mark.parametrize("name, before, after", CHANGES)  # about 10 s a case on 2 shared cores
def test_a_resume_with_another_worker_count_trains_what_the_uninterrupted_run_trained(
        name: str, before: int, after: int, reference, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    ref_checkpoint, ref_record = reference(name)
    root, record = tmp_path / "stopped", tmp_path / "record.txt"
    args = [*ARGS[name], "--trainer.default_root_dir", str(root)]
    assert _fit(name, [*args, "--data.num_workers", str(before)], record, "sigint") == 130
    saved = last_checkpoint(root, 0)
    assert f"interrupted after step {AT + 1}: saved {saved}" in capfd.readouterr().err
    first = [line for line in read_record(record) if int(line.split()[1]) <= AT]
    record.unlink()
    status = _fit(name, [*args, "--data.num_workers", str(after), "--ckpt_path", str(saved)], record)
    assert status == 0, capfd.readouterr().err[-3000:]
    assert first + read_record(record) == ref_record  # the same batches (data and seeds) at the same steps
    _assert_same_weights(ref_checkpoint, last_checkpoint(root, 1))


# ------------------------------------------------------------------ another batch size, image recipe
# a twentieth of the digits trains (90 images): one epoch, validated at its end; 8 -> 16 after 5 steps (40 images)
EPOCH = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "digits",
         "--data.image_size", "8", "--data.val_fraction", "0.95", "--trainer.max_epochs", "1",
         "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_model_summary", "false", "--data.num_workers", "0"]


def test_a_resume_with_another_batch_size_says_so_and_trains_every_image_the_epoch_had_left(
        tmp_path: Path, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    from recipes.vision.data import ImageDataModule

    data = ImageDataModule(dataset="digits", image_size=8, val_fraction=0.95, batch_size=8)
    data.setup("fit")
    n = len(data.train_set)
    reference: list[str] = []
    assert _fit("cifar100", [*EPOCH, "--data.batch_size", "8", "--trainer.default_root_dir", str(tmp_path / "ref")],
                tmp_path / "ref.txt", images=reference) == 0
    assert len(reference) == n // 8 * 8  # the epoch's order, in the uninterrupted run's batches of 8

    root, stopped, resumed = tmp_path / "stopped", [], []
    args = [*EPOCH, "--trainer.default_root_dir", str(root)]
    status = _fit("cifar100", [*args, "--data.batch_size", "8"], tmp_path / "a.txt", "sigint", at=4, images=stopped)
    assert status == 130
    saved = last_checkpoint(root, 0)
    assert final_weights(saved)["step"] == 5 and len(stopped) == 40
    capfd.readouterr()
    caplog.clear()
    with caplog.at_level("INFO", logger="lightning.pytorch"):
        status = _fit("cifar100", [*args, "--data.batch_size", "16", "--ckpt_path", str(saved)], tmp_path / "b.txt",
                      images=resumed)
    assert status == 0, capfd.readouterr().err[-3000:]
    notes = [m for m in caplog.messages if m.startswith("note: resuming")]
    assert notes == [f"note: resuming {saved} with options that differ from the checkpoint's, from its step on: "
                     "--data.batch_size 8 -> 16 (the epoch goes on from the image it reached, in batches of 16; the "
                     "steps of an epoch, and so the length of a schedule over epochs without --trainer.max_steps, "
                     "follow the new size)"]
    left = (n - 40) // 16 * 16  # the images the epoch had left, less the last partial batch (drop_last, as always)
    assert len(resumed) == left  # without EpochPosition: 16 (Lightning counted 5 of the 5 batches of 16 done)
    assert stopped + resumed == reference[:40 + left]  # each once, in the epoch's order and augmentation
    assert final_weights(last_checkpoint(root, 1))["step"] == 5 + left // 16
