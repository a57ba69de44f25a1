"""Reading a checkpoint (``lightning_mrs.callbacks.checkpoint_file``, issue 54 §5): only a damaged archive or a
pickle that does not unpickle is called "truncated or corrupted" / "not a torch checkpoint file"; a
``map_location`` the machine lacks and a class a trusted load cannot import say what they are; the swap
record, the recipes' option check and ``NormSwap.restore`` read a checkpoint without reading its optimizer
state (``mmap=True``: counted in the bytes the process reads from files, ``/proc/self/io``'s ``rchar``)."""

from __future__ import annotations

import re
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from helpers.lightning import TinyModule, assert_same_model, fit
from lightning_mrs.callbacks import NormSwap
from lightning_mrs.callbacks.checkpoint_file import read_checkpoint

#: the optimizer state added to a checkpoint: 32 MiB of float32, far more than the record and the weights
OPTIMIZER_BYTES = 32 * 2**20


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A NormSwap checkpoint whose optimizer state is big (what Adam keeps for a large model)."""
    trainer, model = fit(steps=1, callbacks=[NormSwap()])
    path = tmp_path_factory.mktemp("ckpt") / "big.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["optimizer_states"][0]["state"][99] = {"exp_avg": torch.ones(OPTIMIZER_BYTES // 4)}
    torch.save(checkpoint, path)
    return path, model


def _cut(source: Path, path: Path, keep: float) -> Path:
    data = source.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_file_is_truncated_or_corrupted(trained: tuple[Path, torch.nn.Module], tmp_path: Path,
                                                     keep: float) -> None:
    path = _cut(trained[0], tmp_path / "cut.ckpt", keep)
    with pytest.raises(ValueError, match=rf"^NormSwap.restore: {re.escape(str(path))} is truncated or corrupted \("
                                         r".+\); save or copy it again\.$"):
        NormSwap.restore(TinyModule(), path)


def test_files_that_are_not_checkpoints(tmp_path: Path) -> None:
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint at all\n" * 40)
    with pytest.raises(ValueError, match=rf"^x: {re.escape(str(text))} is not a torch checkpoint file \(.+\); pass "
                                         r"the \.ckpt file that Lightning wrote\.$"):
        read_checkpoint(text, owner="x")
    archive = tmp_path / "photos.zip"  # a whole zip archive, but not torch's
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("a.txt", "hello")
    with pytest.raises(ValueError, match=rf"^x: {re.escape(str(archive))} is not a torch checkpoint file \(a zip "
                                         r"archive without data.pkl\)"):
        read_checkpoint(archive, owner="x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has the device the checkpoint is mapped to")
def test_a_cuda_map_location_on_a_cpu_machine_says_so(trained: tuple[Path, torch.nn.Module]) -> None:
    path = trained[0]
    with pytest.raises(ValueError) as err:
        NormSwap.restore(TinyModule(), path, map_location="cuda:0")
    message = str(err.value)
    assert message.startswith(f"NormSwap.restore: {path}: map_location='cuda:0' names a device this machine does not "
                              "have (RuntimeError: Attempting to deserialize object on a CUDA device but "
                              "torch.cuda.is_available() is False)")
    assert message.endswith("pass map_location='cpu' or one of its devices.") and "corrupted" not in message
    NormSwap.restore(TinyModule(), path, map_location="cpu")  # the same file is fine


def test_a_class_a_trusted_load_cannot_import_is_not_corruption(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gone = types.ModuleType("shims_gone_module")
    exec("class Config:\n    pass\n", gone.__dict__)
    gone.Config.__module__ = "shims_gone_module"
    monkeypatch.setitem(sys.modules, "shims_gone_module", gone)
    path = tmp_path / "objects.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": gone.Config()}, path)
    monkeypatch.delitem(sys.modules, "shims_gone_module")  # e.g. code renamed since the file was saved
    with pytest.raises(ModuleNotFoundError, match="shims_gone_module"):  # torch's own error, not "corrupted"
        read_checkpoint(path, weights_only=False)


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts the bytes read with Linux's /proc/self/io")
def test_the_record_and_the_weights_are_read_without_the_optimizer_state(trained: tuple[Path, torch.nn.Module]) -> None:
    from recipes.common.checkpoints import read_resume_checkpoint, saved_options

    path, model = trained
    assert path.stat().st_size > OPTIMIZER_BYTES
    start = _bytes_read()
    torch.load(path, weights_only=True)  # the control: a plain load reads the whole file
    assert _bytes_read() - start >= OPTIMIZER_BYTES

    start = _bytes_read()
    restored = NormSwap.restore(TinyModule(), path)
    assert _bytes_read() - start < OPTIMIZER_BYTES // 4
    assert_same_model(restored, path, model, torch.randn(2, 3, 8, 8))

    start = _bytes_read()
    checkpoint = read_resume_checkpoint(str(path))  # the recipes' check of --ckpt_path before a resume
    assert saved_options(checkpoint) is not None and _bytes_read() - start < OPTIMIZER_BYTES // 4
    exp_avg = checkpoint["optimizer_states"][0]["state"][99]["exp_avg"]
    assert exp_avg.numel() == OPTIMIZER_BYTES // 4 and bool((exp_avg == 1).all())  # there when asked for
