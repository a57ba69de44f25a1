"""A fault at each point of a fit, then the resume its message prints: the resumed run trains exactly the batches
(their data, their seeds) the uninterrupted run trained, and ends with its weights, bit for bit.

Faults (:mod:`helpers.faults`): ``training_step`` raises, Ctrl-C (SIGINT) mid-step, SIGTERM mid-step, validation
raises, a callback raises after the optimizer's step; both recipes (``cifar100.py`` on the digits, ``lm.py`` on the
standard library's bytes, tiny configs), in-process, and with 2 DDP processes (gloo, CPU) through the scripts.
Each training step records ``rank step batch_idx sha1(batch) seed``; the record of the faulted run before its
checkpoint's step, then the resumed run's, must equal the uninterrupted run's record.

Before this change the image recipe's crash checkpoint counted the batch whose ``training_step`` raised as
consumed: its resume skipped it and every later batch shifted (issue 54, case 5:
``test_a_fault_then_the_resume_trains_what_the_uninterrupted_run_trained[train_step_raises-cifar100]``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from helpers import ROOT
from helpers.faults import KINDS, inject, last_checkpoint, read_record, recipe
from helpers.lm import TINY

# digits: 179 batches of 8 an epoch, so every fault comes in the middle of the first epoch; validation every 2 steps
VISION = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "digits",
          "--data.image_size", "8", "--data.batch_size", "8", "--trainer.max_steps", "6",
          "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
          "--trainer.enable_progress_bar", "false"]
LM = [*TINY, "--trainer.max_steps", "6", "--export", "none"]
ARGS = {"cifar100": VISION, "lm": LM}
AT = 3  # the fault comes in optimizer step 3 (0-based; validation runs after steps 2, 4 and 6)
EXIT = {"sigint": 130, "sigterm": 143}
HINT = re.compile(r"(interrupted|stopped by SIGTERM|failed) after step (\d+): saved (\S+); resume with\n  (.+)")
NO_SAVE = re.compile(r"stopped at step \d+ without a checkpoint \((.+)\); the last checkpoint is (\S+); resume with\n"
                     r"  (.+)")


pytestmark = pytest.mark.usefixtures("python_sigint")


def _fit(name: str, args: list[str], record: Path, fault: Optional[str] = None) -> int:
    """The recipe's ``run(args)`` in-process, recording each step and failing as ``fault`` says."""
    from recipes.common.training import ValidateAtEnd

    run, module = recipe(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [f"{name}.py"])
        inject(module, ValidateAtEnd, fault, AT, str(record), mp.setattr)
        return run(args)


_REFERENCES: dict[str, tuple[Path, list[str]]] = {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """``reference(name)``: the uninterrupted run's final checkpoint and record (one run per recipe and module)."""

    def get(name: str) -> tuple[Path, list[str]]:
        if name not in _REFERENCES:
            root = tmp_path_factory.mktemp(f"uninterrupted-{name}")
            record = root / "record.txt"
            assert _fit(name, [*ARGS[name], "--trainer.default_root_dir", str(root)], record) == 0
            _REFERENCES[name] = (last_checkpoint(root, 0), read_record(record))
        return _REFERENCES[name]

    yield get
    _REFERENCES.clear()


def _assert_same_run(reference: tuple[Path, list[str]], before: list[str], saved: Path, record: Path,
                     resumed: Path) -> None:
    """The faulted run's steps before its checkpoint, then the resumed run's, are the reference's; same weights."""
    ckpt_step = torch.load(saved, map_location="cpu", weights_only=False)["global_step"]
    after = read_record(record)
    combined = sorted([line for line in before if int(line.split()[1]) < ckpt_step] + after,
                      key=lambda line: (int(line.split()[0]), int(line.split()[1])))
    ref_path, ref_record = reference
    assert len(combined) == len(ref_record) == 6 * len({line.split()[0] for line in ref_record})
    assert combined == ref_record  # the same batches (data and seeds) at the same steps
    a = torch.load(ref_path, map_location="cpu", weights_only=False)
    b = torch.load(resumed, map_location="cpu", weights_only=False)
    assert a["global_step"] == b["global_step"] == 6
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][key]), key


def _saved_and_command(err: str) -> tuple[Path, str]:
    m = HINT.search(err) or NO_SAVE.search(err)
    assert m, err[-3000:]
    saved, command = (m.group(3), m.group(4)) if m.re is HINT else (m.group(2), m.group(3))
    assert command.endswith(f"--ckpt_path {saved}"), command
    return Path(saved), command


CASES = [pytest.param(kind, name, marks=() if (kind, name) == ("train_step_raises", "cifar100") else pytest.mark.slow,
                      id=f"{kind}-{name}") for name in ("cifar100", "lm") for kind in KINDS]


@pytest.mark.parametrize("kind, name", CASES)  # slow: about 20 s a case on 2 shared cores (two fits)
def test_a_fault_then_the_resume_trains_what_the_uninterrupted_run_trained(
        kind: str, name: str, reference, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    ref = reference(name)
    capfd.readouterr()
    root, record = tmp_path / "faulted", tmp_path / "record.txt"
    args = [*ARGS[name], "--trainer.default_root_dir", str(root)]
    if kind in EXIT:
        assert _fit(name, args, record, kind) == EXIT[kind]
    else:
        with pytest.raises(RuntimeError, match="injected fault"):
            _fit(name, args, record, kind)
    err = capfd.readouterr().err
    saved, command = _saved_and_command(err)
    expected = {"sigint": "last.ckpt", "sigterm": "last.ckpt"}.get(kind, "crash.ckpt")
    assert saved == root / "lightning_logs" / "version_0" / "checkpoints" / expected, err[-3000:]
    assert f"--trainer.default_root_dir {root}" in command
    before = read_record(record)
    record.unlink()
    assert _fit(name, [*args, "--ckpt_path", str(saved)], record) == 0
    _assert_same_run(ref, before, saved, record, last_checkpoint(root, 1))


# ------------------------------------------------------------------ two DDP processes, through the scripts
DDP = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]


def _script(name: str, args: list[str], record: Path, fault: Optional[str] = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RECORD": str(record),
           "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    env.pop("FAULT", None)
    if fault:
        env["FAULT"] = f"{fault}@{AT}"
    return subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "faults.py"), name, *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, tuple[Path, list[str]]] = {}

    def get(name: str) -> tuple[Path, list[str]]:
        if name not in cache:
            root = tmp_path_factory.mktemp(f"ddp-uninterrupted-{name}")
            proc = _script(name, [*ARGS[name], *DDP, "--trainer.default_root_dir", str(root)], root / "record.txt")
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[name] = (last_checkpoint(root, 0), read_record(root / "record.txt"))
        return cache[name]

    return get


@pytest.mark.slow  # about 2 minutes a case on 2 shared cores: three multi-process fits
@pytest.mark.parametrize("name", ["cifar100", "lm"])
@pytest.mark.parametrize("kind", ["sigint", "sigterm", "train_step_raises"])
def test_ddp_a_fault_then_the_resume_trains_what_the_uninterrupted_run_trained(
        kind: str, name: str, ddp_reference, tmp_path: Path) -> None:
    """Ctrl-C and SIGTERM reach every process mid-step: all stop after the same step and save it. A failure of
    ``training_step`` (on every process) saves nothing (the others could be waiting in a collective): the message
    names the last checkpoint, and resuming it trains what the uninterrupted run trained."""
    ref = ddp_reference(name)
    root, record = tmp_path / "faulted", tmp_path / "record.txt"
    args = [*ARGS[name], *DDP, "--trainer.default_root_dir", str(root)]
    proc = _script(name, args, record, kind)
    assert proc.returncode == EXIT.get(kind, 1), proc.stderr[-3000:]
    saved, _ = _saved_and_command(proc.stderr)
    if kind == "train_step_raises":
        assert "a multi-process run cannot save once one process has failed" in proc.stderr
        assert saved == last_checkpoint(root, 0) and not saved.with_name("crash.ckpt").exists()
    before = read_record(record)
    record.unlink()
    proc = _script(name, [*args, "--ckpt_path", str(saved)], record)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_run(ref, before, saved, record, last_checkpoint(root, 1))
