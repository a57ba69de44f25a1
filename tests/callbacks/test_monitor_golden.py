"""The three monitors log, to the bit, what they logged before their refactoring (issue 63).

``golden/monitors.json`` was written by this file run on the code *before* the monitors shared
one accumulator, capture and metrics table (``python tests/callbacks/test_monitor_golden.py
--regen``): for each scenario, every scalar every monitor logged (tag -> step -> value, the
float's exact ``repr``), every ``G_i`` histogram, the last TensorBoard custom-scalars layout and
each monitor's ``state_dict``. The scenarios cover one process (eager, compiled, gradient
accumulation, manual optimization with two optimizers) and two gloo DDP processes; each runs
all three monitors on a model they all watch. The values must be *equal*: the refactoring
kept every formula and its reduction order, so not even an ulp may move. The golden values hold for
this CPU's C++ kernels: ``per_sample_manual`` was regenerated when the per-sample kernels moved to 16
lanes (issue 62), which moved that model's float32 activations and so its figures by at most 1.2e-6
relative; the monitors' code was then the one that matched the first golden exactly.

Run as ``python tests/callbacks/test_monitor_golden.py ddp OUT.json`` this file is the DDP job.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from helpers.ddp import RankStride, run_job
from helpers.lightning import ManualModule, TinyModule, fit, image_data, per_sample_net
from helpers.outliers import planted_net
from helpers.recording_logger import RecordingLogger
from lightning_mrs import swap_norms
from lightning_mrs.callbacks import AttentionMonitor, GradientHomogeneityMonitor, OutlierMonitor

timm = pytest.importorskip("timm")

GOLDEN = Path(__file__).parent / "golden" / "monitors.json"
SIZE = (8, 8)
Record = dict[str, Any]


class _Writer:
    """What a TensorBoard ``SummaryWriter`` is asked to store: histograms and the layout."""

    def __init__(self) -> None:
        self.histograms: dict[str, dict[str, list[float]]] = {}
        self.layout: Any = None

    def add_histogram(self, tag: str, values: torch.Tensor, step: int) -> None:
        self.histograms.setdefault(tag, {})[str(step)] = values.tolist()

    def add_custom_scalars(self, layout: dict) -> None:
        self.layout = layout

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None  # scalars come through RecordingLogger


class HistogramLogger(TensorBoardLogger):
    """A TensorBoardLogger (the monitors write their histograms and layout to it) that keeps them."""

    def __init__(self, save_dir: str) -> None:
        super().__init__(save_dir)
        self.writer = _Writer()

    @property
    def experiment(self) -> _Writer:
        return self.writer

    def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
        pass

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def save(self) -> None:
        pass

    def finalize(self, status: str) -> None:
        pass


def vit(qk_norm: Optional[str] = "mrs", compiled: bool = False) -> nn.Module:
    """A 2-block timm ViT whose softmax rows are peaky (hot q/k weights), QK-norm ``qk_norm``."""
    net = timm.create_model("vit_tiny_patch16_224", img_size=SIZE, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                            num_classes=5)
    with torch.no_grad():
        for block in net.blocks:
            block.attn.qkv.weight[:32] *= 20.0
    if qk_norm is not None:
        swap_norms(net, None, qk_norm=qk_norm)
        for block in net.blocks:
            for norm in (block.attn.q_norm, block.attn.k_norm):
                nn.init.uniform_(norm.weight, 0.5, 3.0)
    return torch.compile(net, backend="eager") if compiled else net


def monitors() -> list[pl.Callback]:
    return [GradientHomogeneityMonitor(histogram_every_n_logs=1), AttentionMonitor(max_queries=6),
            OutlierMonitor()]


def _record(callbacks: list[pl.Callback], rec: RecordingLogger, tb: HistogramLogger) -> Record:
    return {
        "scalars": {tag: {str(step): v for step, v in series.items()}
                    for tag, series in sorted(rec.history.items()) if "/" in tag and not tag.startswith("train/")},
        "histograms": tb.writer.histograms,
        "layout": tb.writer.layout,
        "state": [cb.state_dict() for cb in callbacks],
    }


# name -> (module factory, fit keyword arguments)
SCENARIOS: dict[str, tuple[Callable[[], pl.LightningModule], dict[str, Any]]] = {
    "vit_mrs": (lambda: TinyModule(vit), dict(steps=3, data=image_data(24, SIZE), batch_size=8)),
    "vit_mrs_compiled": (lambda: TinyModule(lambda: vit(compiled=True)),
                         dict(steps=3, data=image_data(24, SIZE), batch_size=8)),
    "vit_plain_accumulated": (lambda: TinyModule(lambda: vit(None)),
                              dict(steps=2, data=image_data(32, SIZE), batch_size=4, accumulate_grad_batches=2)),
    "per_sample_manual": (lambda: ManualModule(per_sample_net), dict(steps=6, data=image_data(24), batch_size=8)),
    "planted_accumulated": (lambda: TinyModule(planted_net),
                            dict(steps=2, data=image_data(24, (4, 4)), batch_size=4, accumulate_grad_batches=3,
                                 log_every_n_steps=2)),
}


def run(name: str, tmp: str) -> Record:
    factory, kwargs = SCENARIOS[name]
    torch._dynamo.reset()
    callbacks, rec, tb = monitors(), RecordingLogger(), HistogramLogger(tmp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the monitors' notes about the tiny runs
        fit(factory(), callbacks=callbacks, logger=[rec, tb], **kwargs)
    return _record(callbacks, rec, tb)


class _DumpRecord(pl.Callback):
    def __init__(self, path: str, callbacks: list[pl.Callback], tmp: str) -> None:
        self.path, self.callbacks, self.tmp = path, callbacks, tmp

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            rec, tb = trainer.loggers
            Path(self.path).write_text(json.dumps(_record(self.callbacks, rec, tb)))


def ddp_job(out: str) -> None:
    """Two gloo ranks, each a half of every global batch of 8, all three monitors."""
    callbacks = monitors()
    data = image_data(24, SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(TinyModule(vit), steps=3, data=data, sampler=RankStride(len(data)), batch_size=4, devices=2,
            strategy="ddp", use_distributed_sampler=False, logger=[RecordingLogger(), HistogramLogger(out + ".tb")],
            callbacks=[*callbacks, _DumpRecord(out, callbacks, out + ".tb")])


def _golden() -> dict[str, Record]:
    return json.loads(GOLDEN.read_text())


def assert_same(got: Record, want: Record) -> None:
    """Equal tags, steps and values (Python floats compare exactly), histograms, layout and state."""
    assert got["scalars"].keys() == want["scalars"].keys()
    for tag, series in want["scalars"].items():
        assert got["scalars"][tag] == series, tag
    assert got["histograms"] == want["histograms"]
    assert got["layout"] == want["layout"]
    assert got["state"] == want["state"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_single_process_matches_golden(name: str, tmp_path: Path) -> None:
    want = _golden()[name]
    assert len(want["scalars"]) > 20 and want["layout"]  # the golden holds real figures
    assert_same(json.loads(json.dumps(run(name, str(tmp_path)))), want)


@pytest.mark.slow  # a 2-process gloo job: 20-60 s on 2 busy cores
def test_ddp_matches_golden(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    proc = run_job(Path(__file__).resolve(), "ddp", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_same(json.loads(out.read_text()), _golden()["ddp"])


if __name__ == "__main__":
    if sys.argv[1] == "ddp":
        ddp_job(sys.argv[2])
    elif sys.argv[1] == "--regen":  # on the code the goldens are to pin (before a refactoring)
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            golden = {name: run(name, tmp) for name in SCENARIOS}
            job = run_job(Path(__file__).resolve(), "ddp", f"{tmp}/rank0.json")
            assert job.returncode == 0, job.stderr[-3000:]
            golden["ddp"] = json.loads(Path(f"{tmp}/rank0.json").read_text())
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=0, sort_keys=True) + "\n")
