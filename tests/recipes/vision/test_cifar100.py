"""recipes/cifar100.py through its real command line (subprocesses), plus its building blocks."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from helpers import ROOT
from helpers.scripts import run_script
from helpers.tensorboard import event_scalars, session_start, time_series_groups
from recipes.vision.classifier import ImageClassifier
from recipes.common.training import default_precision
from recipes.vision.models import build_model
from recipes.common.errors import UsageError

SCRIPT = ROOT / "recipes" / "cifar100.py"

# Small and fast on the CPU; the real default is resnet18.
FAST = ["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset", "synthetic",
        "--data.synthetic_val_size", "96", "--trainer.limit_val_batches", "2", "--data.batch_size", "16",
        "--trainer.enable_progress_bar", "false"]


_run = partial(run_script, SCRIPT, timeout=300)


def test_fit_validate_checkpoint_and_reload(tmp_path: Path) -> None:
    steps, lr = 3, 0.05
    proc = _run([*FAST, "--model.norm", "mrs", "--model.mrs_backend", "eager", "--model.lr", str(lr),
                 "--model.warmup_frac", "0.0",
                 "--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", "1",
                 "--trainer.default_root_dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "lightning_logs" / "version_0"
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("*.ckpt"))
    assert "last.ckpt" in ckpts and any(n.startswith("best-") for n in ckpts), ckpts
    assert list(run.glob("events.out.tfevents.*")), "no TensorBoard events"
    assert "precision: 32-true" in (run / "config.yaml").read_text()  # the CPU default, chosen in code
    assert "global batch 16 = 16 per device x 1 processes" in proc.stdout + proc.stderr

    scalars = event_scalars(run)
    # validation ran (once) although max_steps ended the run inside the first epoch; Lightning
    # logs it at the index of the last training batch (steps - 1)
    assert [s for s, _ in scalars["val/top1"]] == [steps - 1]
    assert 0.0 <= scalars["val/top1"][0][1] <= 1.0
    for tag in ("train/loss", "train/epoch", "val/loss", "val/top5"):
        assert tag in scalars, sorted(scalars)
    assert any(t.startswith("phasor/all/") for t in scalars), sorted(scalars)
    # TensorBoard's Time Series opens on the result: accuracy/* (train/top1's and val/top1's values) first
    assert time_series_groups(scalars)[0] == ("accuracy", ["accuracy/train", "accuracy/val"])
    assert scalars["accuracy/val"] == scalars["val/top1"] and scalars["accuracy/train"] == scalars["train/top1"]
    assert "hp_metric" not in scalars and "epoch" not in scalars
    # the HParams session: the final metrics (z-final/*, at the last step) and the settings
    assert scalars["z-final/top1"] == scalars["z-final/best_top1"] == [(steps, scalars["val/top1"][-1][1])]
    assert scalars["z-final/val_loss"] == [(steps, scalars["val/loss"][-1][1])]
    assert scalars["z-final/diverged"] == [(steps, 0.0)] and "z-final/max_logit" not in scalars  # no attention
    start = session_start(run)
    assert start["norm"].string_value == "mrs" and start["lr"].number_value == lr
    assert start["global_batch_size"].number_value == 16 and start["seed"].number_value == 0
    assert start["precision"].string_value == "32-true" and start["dataset"].string_value == "synthetic"
    # per-step cosine schedule, no warm-up: lr_k = lr/2 (1 + cos(pi k / steps)) (independent formula)
    lrs = [v for _, v in sorted(scalars["train/lr"])]
    expected = [lr * 0.5 * (1 + math.cos(math.pi * k / steps)) for k in range(steps)]
    torch.testing.assert_close(torch.tensor(lrs[:steps], dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), atol=1e-7, rtol=1e-5)

    # load_from_checkpoint rebuilds the swapped architecture from the hyperparameters alone
    from lightning_mrs import MRSNorm2d

    path = run / "checkpoints" / "last.ckpt"
    model = ImageClassifier.load_from_checkpoint(path, map_location="cpu")
    assert model.hparams.norm == "mrs" and model.hparams.arch == "timm:test_resnet"
    assert any(isinstance(m, MRSNorm2d) for m in model.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    saved = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, saved[name], atol=0, rtol=0)
    model.eval()
    with torch.no_grad():
        logits = model(torch.randn(4, 3, 32, 32))  # (4, 100)
    assert logits.shape == (4, 100) and torch.isfinite(logits).all()

    # the logged val/top1 is the plain share of the validated images (2 batches of 16) it gets right
    from recipes.vision.data import ImageDataModule

    dm = ImageDataModule(dataset="synthetic", synthetic_val_size=96, batch_size=16)
    dm.setup("fit")
    hits = []
    with torch.no_grad():
        for i, (x, y) in enumerate(dm.val_dataloader()):
            if i == 2:
                break
            hits.append(model(x).argmax(1) == y)  # (16,)
    assert scalars["val/top1"][0][1] == pytest.approx(torch.cat(hits).double().mean().item(), abs=1e-6)


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_ddp_two_processes_on_cpu(tmp_path: Path) -> None:
    proc = _run([*FAST, "--model.norm", "layer", "--trainer.devices", "2", "--trainer.strategy", "ddp",
                 "--trainer.max_steps", "2", "--trainer.default_root_dir", str(tmp_path)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "global batch 32 = 16 per device x 2 processes" in out
    assert "distributed_backend=gloo" in out
    ckpts = list((tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert len(ckpts) == 2, ckpts  # last + best, written once (rank zero)
    scalars = event_scalars(tmp_path / "lightning_logs" / "version_0")
    assert [s for s, _ in scalars["val/top1"]] == [1]


def test_missing_cifar100_fails_cleanly(tmp_path: Path, error_line: Callable[[int, str], str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    # default --data.download true: offline the download fails (bounded by a socket timeout)
    proc = _run([*FAST, "--data.dataset", "cifar100", "--data.root", str(empty), "--trainer.max_steps", "1",
                 "--trainer.default_root_dir", str(tmp_path / "run")], timeout=240)
    line = error_line(proc.returncode, proc.stdout + proc.stderr)
    assert "CIFAR-100 is not available" in line
    assert str(empty) in line and "--data.root" in line and "--data.dataset digits" in line


# Through the script, with Python's warnings on: one stderr line each (a subprocess costs ~6 s of
# CPU in imports, so the other mistakes go through run() in-process below).
SCRIPT_MISTAKES = [
    (["--model.arch", "resnet19"], ["--model.arch 'resnet19'", "did you mean 'resnet18'"]),
    (["--model.norm", "group"], ["model.norm", "'mrs', 'rms', 'layer', 'batch', 'dyt', 'derf'", "group"]),
    (["--data.dataset", "folder", "--data.root", "no/such/dir"], ["--data.root 'no/such/dir'", "DIR/train/<class>"]),
]


@pytest.mark.parametrize("args,needles", [  # one through the script in the default suite (15 s each), all with -m slow
    pytest.param(*SCRIPT_MISTAKES[0], id="arch", marks=pytest.mark.slow), pytest.param(*SCRIPT_MISTAKES[1], id="parser"),
    pytest.param(*SCRIPT_MISTAKES[2], id="folder", marks=pytest.mark.slow)])
def test_mistakes_through_the_script(args: list[str], needles: list[str], tmp_path: Path,
                                     error_line: Callable[[int, str], str]) -> None:
    proc = run_script(SCRIPT, ["--trainer.default_root_dir", str(tmp_path), *args], timeout=300, warnings=True)
    line = error_line(proc.returncode, proc.stdout + proc.stderr)
    for needle in needles:
        assert needle in line


IN_PROCESS_MISTAKES = [
    (["--model.arch", "foo:resnet18"], "the prefix must be 'tv:' or 'timm:'"),
    (["--model.arch", "tv:resnt18"], "did you mean 'resnet18'"),
    (["--model.arch_kwargs", '{"layerz": 1}'], "--model.arch_kwargs"),
    (["--model.schedule", "step"], "model.schedule"),
    (["--model.warmup_frac", "1.0"], "--model.warmup_frac must lie in [0, 1)"),
    (["--model.lr", "0"], "--model.lr must be > 0"),
    (["--model.lr", "fast"], "model.lr"),
    (["--model.mrs_backend", "cuda"], "--model.mrs_backend 'cuda' is not valid; choose one of"),
    (["--data.val_fraction", "1.5"], "--data.val_fraction must lie in (0, 1)"),
    (["--data.image_size", "4"], "--data.image_size must be >= 8"),
    (["--data.batch_size", "0"], "--data.batch_size must be >= 1"),
    (["--data.dataset", "imagenet"], "data.dataset"),
    (["--data.dataset", "cifar100", "--data.root", "{tmp}", "--data.download", "false"],
     "--data.download is false"),
    (["--ckpt_path", "{tmp}/none.ckpt"], "--ckpt_path"),
    (["--config", "{tmp}/none.yaml"], "none.yaml"),
    (["--trainer.strategy", "foo"], "a --trainer option: You selected an invalid strategy name"),
    (["--trainer.max_epochs", "many"], "trainer.max_epochs"),
]


@pytest.mark.parametrize("args,needle", IN_PROCESS_MISTAKES, ids=lambda v: v[1] if isinstance(v, list) else None)
def test_mistakes_are_one_line(args: list[str], needle: str, tmp_path: Path,
                               recipe_error: Callable[[list[str]], str]) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    line = recipe_error(["--trainer.accelerator", "cpu", "--model.arch", "timm:test_resnet", "--data.dataset",
                         "digits", "--trainer.default_root_dir", str(tmp_path), *args])
    assert needle in line


@pytest.mark.parametrize("arch", ["resnet18", "timm:resnet18", "timm:resnet10t"])
def test_cifar_stem_keeps_resolution(arch: str) -> None:
    model = build_model(arch, num_classes=100)
    assert isinstance(model.maxpool, nn.Identity)
    first = next(m for m in model.conv1.modules() if isinstance(m, nn.Conv2d))
    assert first.stride == (1, 1)
    seen = {}

    def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["layer1"] = output.shape  # (N, C, H, W)

    model.layer1.register_forward_hook(record)
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    assert seen["layer1"][-2:] == (32, 32)  # an ImageNet stem would give 8x8


def test_imagenet_stem_kept_on_request_and_non_resnets_untouched() -> None:
    model = build_model("resnet18", num_classes=10, cifar_stem=False)
    assert model.conv1.stride == (2, 2) and isinstance(model.maxpool, nn.MaxPool2d)
    vit = build_model("timm:test_vit", num_classes=7)
    assert vit(torch.randn(1, 3, 160, 160)).shape == (1, 7)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"norm": "group"}, "--model.norm"), ({"schedule": "step"}, "--model.schedule"),
     ({"warmup_frac": 1.0}, "--model.warmup_frac"), ({"lr": 0.0}, "--model.lr"),
     ({"mrs_backend": "cuda"}, "--model.mrs_backend"), ({"arch": "no_such_model_xyz"}, "--model.arch")],
)
def test_bad_options_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        ImageClassifier(**{"arch": "timm:test_resnet", **kwargs})


class _FixedLogits(nn.Module):
    """Returns the next rows of a given logit table, whatever the input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits, self.at = logits, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.logits[self.at:self.at + len(x)]  # (N, K)
        self.at += len(x)
        return out


def test_accuracy_is_plain_micro_accuracy() -> None:
    """top-1/top-5 are the share of correct samples, not torchmetrics' default per-class (macro) mean."""
    k = 7
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(11, k, generator=g, dtype=torch.float64).float()  # (11, 7)
    # unbalanced classes, two classes absent: a per-class average differs from the plain share
    y = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 3, 3, 4])
    logits[[0, 1, 2, 5, 9], y[[0, 1, 2, 5, 9]]] += 10.0  # make these five right
    top1 = (logits.argmax(1) == y).double().mean()
    top5 = (logits.topk(5, dim=1).indices == y[:, None]).any(1).double().mean()
    per_class = [(logits.argmax(1) == y)[y == c].double().mean() for c in y.unique()]
    assert abs(top1 - torch.stack(per_class).mean()) > 0.05  # the data tells the two apart

    model = ImageClassifier(arch="timm:test_resnet", norm="batch", num_classes=k)
    model.model = _FixedLogits(logits)
    x = torch.zeros(11, 3, 8, 8)
    with pytest.warns(UserWarning, match="self.log"):  # no trainer: logging is skipped, metrics update
        model.validation_step((x[:6], y[:6]), 0)  # two batches: the state accumulates
        model.validation_step((x[6:], y[6:]), 1)
    assert model.val_top1.compute().item() == pytest.approx(top1.item(), abs=1e-6)
    assert model.val_top5.compute().item() == pytest.approx(top5.item(), abs=1e-6)
    model.model.at = 0
    with pytest.warns(UserWarning, match="self.log"):
        model.training_step((x, y), 0)
    assert model.train_top1.compute().item() == pytest.approx(top1.item(), abs=1e-6)


def test_batch_norm_means_no_swap() -> None:
    model = ImageClassifier(arch="timm:test_resnet", norm="batch")
    assert model.swap_report is None
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) > 0


def test_default_precision() -> None:
    assert default_precision("cpu") == "32-true"
    if not torch.cuda.is_available():
        assert default_precision("auto") == "32-true"
    else:
        assert default_precision("gpu") == ("bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed")
