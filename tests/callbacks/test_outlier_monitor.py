"""OutlierMonitor in real (tiny, CPU) Trainer runs, against the float64 figures of each norm
layer's input computed directly (:mod:`helpers.outliers`) on a net with planted outlier channels.

Run as a script (``python tests/callbacks/test_outlier_monitor.py OUT.json``) this file is
also the 2-process gloo ``ddp`` job of :func:`test_ddp_gloo_matches_single_process`: rank 0
writes what it logged to ``OUT.json``.
"""

from __future__ import annotations

import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from helpers.ddp import ddp_matches_single_process, split_fit
from helpers.lightning import ManualModule, TinyModule, fit, image_data
from helpers.monitors import assert_state_round_trip, tensorboard_run
from helpers.outliers import PLANTED, all_figure, planted_net, planted_reference
from helpers.recording_logger import RecordingLogger, monitor_tag
from lightning_mrs.callbacks import GradientHomogeneityMonitor, OutlierMonitor
from lightning_mrs.callbacks.tb_layout import OUTLIER
from lightning_mrs.outlier_stats import FIGURE_NAMES

BATCH, GLOBAL_BATCH, STEPS = 8, 8, 2
# TinyModule's names of planted_net's norms -> their channel dim
NORMS = {"1": 1, "3": 1, "4.norm": -1, "4.odd_norm": -1}
NORMS_BN = {"1": 1, "2": 1, "4": 1, "5.norm": -1, "5.odd_norm": -1}


def planted_bn() -> nn.Module:
    return planted_net(batchnorm=True)


def outlier_tags(rec: RecordingLogger) -> dict[str, dict[int, float]]:
    return {tag: series for tag, series in rec.history.items() if monitor_tag(tag, "outlier/")}


@pytest.mark.parametrize("batchnorm", [False, True])
def test_figures_match_direct_float64(recording_logger: RecordingLogger, batchnorm: bool) -> None:
    net_fn, norms = (planted_bn, NORMS_BN) if batchnorm else (planted_net, NORMS)
    fit(TinyModule(net_fn), steps=1, logger=recording_logger, data=image_data(BATCH), batch_size=BATCH,
        callbacks=[OutlierMonitor()])
    torch.manual_seed(0)  # as TinyModule builds its net
    ref = planted_reference(net_fn(), image_data(BATCH)[:BATCH][0], norms)
    got = outlier_tags(recording_logger)
    expected_tags = {f"z-layers/outlier/{layer}/{f}" for layer, row in ref.items() for f in row}
    expected_tags |= {f"outlier/all/{f}" for f in FIGURE_NAMES}
    assert got.keys() == expected_tags
    for layer, row in ref.items():
        for figure, value in row.items():
            assert got[f"z-layers/outlier/{layer}/{figure}"] == {0: pytest.approx(value, rel=1e-5, abs=1e-7)}, (layer, figure)
    for figure in FIGURE_NAMES:
        assert got[f"outlier/all/{figure}"][0] == pytest.approx(all_figure(ref, figure), rel=1e-5, abs=1e-7), figure
    # odd width: no phasor share; the planted conv channel dominates the first norm's input
    head = "net.5" if batchnorm else "net.4"
    assert f"z-layers/outlier/{head}.odd_norm/mrs_share" not in got and f"z-layers/outlier/{head}.norm/mrs_share" in got
    first = ref["net.1"]
    assert first["outlier_ratio"] > PLANTED / 4 and first["rms_share"] > first["mrs_share"] > 0.5
    assert first["absmax"] > 256 and first["x2_over_fp16_frac"] > 0


def test_a_transformers_llama_is_watched_by_its_own_norms() -> None:
    """LlamaRMSNorm (the model's own class): every instance watched, figures as float64 gives them."""
    transformers = pytest.importorskip("transformers")
    from lightning_mrs.callbacks.capture import layer_metrics
    from lightning_mrs.callbacks.outlier_report import OutlierCapture, find_norm_inputs
    from lightning_mrs.callbacks.tb_layout import OUTLIER
    from lightning_mrs.outlier_stats import FIGURES

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    with torch.no_grad():
        model.embed_tokens.weight[:, 3] *= 50.0  # a massive-activation channel in the residual stream
    layers, unwatchable = find_norm_inputs(model)
    names = {layer.name for layer in layers}
    assert {"layers.0.input_layernorm", "layers.1.post_attention_layernorm", "norm"} <= names and not unwatchable
    ids = torch.randint(0, 64, (2, 9))
    capture = OutlierCapture(layers, step=0, device=torch.device("cpu"))
    capture.arm()
    model(ids)
    capture.disarm()
    got = layer_metrics(OUTLIER.tag, layers, capture.sums, FIGURES, "tokens", lambda layer: FIGURE_NAMES)
    ref = planted_reference(model, ids, {name: -1 for name in names}, prefix="")
    for layer, row in ref.items():
        for figure, value in row.items():
            assert got[f"z-layers/outlier/{layer}/{figure}"] == pytest.approx(value, rel=1e-5, abs=1e-7), (layer, figure)
    assert ref["layers.0.input_layernorm"]["outlier_ratio"] > 20


@pytest.mark.parametrize("module_cls,interval,kw", [
    (TinyModule, 2, {}),
    (TinyModule, 1, {"accumulate_grad_batches": 2}),  # 5 batches an epoch: the odd last one steps alone
    (ManualModule, 2, {}),  # two optimizers: global_step advances by 2 a batch
])
def test_logging_steps_line_up_with_train_loss(recording_logger: RecordingLogger,
                                               module_cls: type, interval: int, kw: dict) -> None:
    steps = 5 if module_cls is TinyModule else 10
    fit(module_cls(planted_net), steps=steps, logger=recording_logger, log_every_n_steps=interval,
        data=image_data(40), callbacks=[OutlierMonitor()], **kw)
    expected = list(range(interval - 1, 5, interval))
    assert sorted(recording_logger.history["train/loss"]) == expected
    tags = outlier_tags(recording_logger)
    assert {"z-layers/outlier/net.1/kurtosis", "z-layers/outlier/net.4.norm/mrs_share", "outlier/all/absmax"} <= tags.keys()
    assert all(sorted(series) == expected for series in tags.values()), tags


def test_accumulated_micro_batches_add_up() -> None:
    logs = []
    for batch_size, accumulate in ((8, 1), (4, 2)):
        rec = RecordingLogger()
        fit(TinyModule(planted_net), steps=2, logger=rec, data=image_data(32), batch_size=batch_size,
            accumulate_grad_batches=accumulate, callbacks=[OutlierMonitor()])
        logs.append(outlier_tags(rec))
    whole, accumulated = logs
    assert whole.keys() == accumulated.keys() and len(whole) > 20
    for tag, series in whole.items():
        assert accumulated[tag] == pytest.approx(series, rel=1e-4, abs=1e-6), tag


class WithValidation(TinyModule):
    """Validation on inputs 30 times larger: captured, they would change every figure."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0] * 30.0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(image_data(8, seed=2), batch_size=4)


def monitor_hooks(module: nn.Module) -> int:
    """Forward pre-hooks on ``module`` besides the test's own probe."""
    return len(module._forward_pre_hooks) - 1


class BackwardProbe(pl.Callback):
    """After the monitor: the hooks on the first norm when backward starts."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.seen.append(monitor_hooks(pl_module.net[1]))


def test_hooks_only_in_the_training_forward_of_logging_steps() -> None:
    calls: list[tuple[str, int, int]] = []  # (stage, global step, monitor hooks) per call of the first norm
    runs = []
    for module_cls in (TinyModule, WithValidation):
        module = module_cls(planted_net)
        norm = module.net[1]
        norm.register_forward_pre_hook(lambda m, args: calls.append(
            ("train" if module.trainer.training else "val", module.trainer.global_step, monitor_hooks(m))))
        rec, probe = RecordingLogger(), BackwardProbe()
        calls.clear()
        fit(module, steps=4, logger=rec, data=image_data(32), log_every_n_steps=2, val_check_interval=1,
            num_sanity_val_steps=1, callbacks=[OutlierMonitor(), probe])
        runs.append(outlier_tags(rec))
        assert probe.seen == [0, 0, 0, 0]  # removed right after the training forward
        assert monitor_hooks(norm) == 0
    assert {c for c in calls if c[0] == "train"} == {("train", 0, 0), ("train", 1, 1), ("train", 2, 0), ("train", 3, 1)}
    assert {c for c in calls if c[0] == "val"} == {("val", s, 0) for s in (0, 1, 2, 3, 4)}  # sanity check at 0
    plain, validated = runs
    assert plain == validated  # validation forwards left no trace
    assert sorted(plain["outlier/all/absmax"]) == [1, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_figures_are_those_of_the_half_inputs(recording_logger: RecordingLogger,
                                                               dtype: torch.dtype) -> None:
    """Under autocast the conv/linear outputs enter the norms in bf16 (``bf16-mixed``) or fp16 (true
    fp16 autocast with a GradScaler, as the CPU allows it): the figures are those of these half
    values in float64, not of half arithmetic."""
    from lightning.pytorch.plugins import MixedPrecision

    kw: dict[str, Any] = {"precision": "bf16-mixed"} if dtype == torch.bfloat16 else {
        "plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    fit(TinyModule(planted_net), steps=1, logger=recording_logger, data=image_data(BATCH), batch_size=BATCH,
        callbacks=[OutlierMonitor()], **kw)
    torch.manual_seed(0)
    net = planted_net()
    dtypes = []
    net[1].register_forward_pre_hook(lambda m, args: dtypes.append(args[0].dtype))
    with torch.autocast("cpu", dtype=dtype):
        ref = planted_reference(net, image_data(BATCH)[:BATCH][0], NORMS)
    assert dtypes == [dtype]
    got = outlier_tags(recording_logger)
    for layer, row in ref.items():
        for figure, value in row.items():
            assert got[f"z-layers/outlier/{layer}/{figure}"] == {0: pytest.approx(value, rel=1e-5, abs=1e-7)}, (layer, figure)
    assert got["z-layers/outlier/net.1/x2_over_fp16_frac"][0] > 0


def test_figures_and_per_layer_select_what_is_logged(recording_logger: RecordingLogger) -> None:
    fit(TinyModule(planted_net), steps=1, logger=recording_logger,
        callbacks=[OutlierMonitor(figures=["mrs_share", "absmax"], per_layer=False)])
    assert outlier_tags(recording_logger).keys() == {"outlier/all/absmax", "outlier/all/mrs_share"}


def test_the_figure_of_0_2_0_under_its_old_name(recording_logger: RecordingLogger, tmp_path: Path) -> None:
    """``fp16_overflow_frac`` (0.2.0) is ``x2_over_fp16_frac`` now: the old name is taken with a warning and
    logged under the new tag, and the dashboard's chart matches both tags, so old and new runs share it."""
    with pytest.warns(FutureWarning, match=r"\['fp16_overflow_frac'\] are now called \['x2_over_fp16_frac'\]"):
        monitor = OutlierMonitor(figures=["fp16_overflow_frac", "absmax"], per_layer=False)
    assert monitor.figures == ("absmax", "x2_over_fp16_frac")
    fit(TinyModule(planted_net), steps=1, logger=recording_logger, callbacks=[monitor])
    assert outlier_tags(recording_logger).keys() == {"outlier/all/absmax", "outlier/all/x2_over_fp16_frac"}
    layout = OUTLIER.layout(["net.1"])
    charts, per_layer = layout[OUTLIER.category], layout[f"{OUTLIER.category}: net.1"]
    (_, chart), = [value for title, value in charts.items() if title.startswith("x2_over_fp16_frac")]
    (_, layer_chart), = [value for title, value in per_layer.items() if title.startswith("x2_over_fp16_frac")]
    assert [any(re.match(p, tag) for p in chart) for tag in ("outlier/all/x2_over_fp16_frac",
            "outlier/all/fp16_overflow_frac")] == [True, True]
    assert [any(re.match(p, tag) for p in layer_chart) for tag in ("z-layers/outlier/net.1/x2_over_fp16_frac",
            "z-layers/outlier/net.1/fp16_overflow_frac")] == [True, True]
    tb = TensorBoardLogger(tmp_path, name="tb")
    fit(TinyModule(planted_net), steps=1, logger=tb, callbacks=[OutlierMonitor(per_layer=False)])
    assert set(chart) <= set(tensorboard_run(tb.log_dir)[1][OUTLIER.category])  # the layout the run wrote


def test_include_selects_layers(recording_logger: RecordingLogger) -> None:
    fit(TinyModule(planted_net), steps=1, logger=recording_logger, callbacks=[OutlierMonitor(include=r"norm$")])
    layers = {tag.split("/")[-2] for tag in outlier_tags(recording_logger)}
    assert layers == {"net.4.norm", "net.4.odd_norm", "all"}


class WeirdNorm(nn.Module):
    """Named like a norm, no channel count to find."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


class PreNorm(nn.Module):
    """A wrapper named like a norm: its LayerNorm child is the norm."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(x))


def odd_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Flatten(), nn.utils.parametrizations.weight_norm(nn.Linear(105, 20)), WeirdNorm(), PreNorm(20),
        nn.Unflatten(1, (4, 5)), nn.LayerNorm((4, 5)), nn.Flatten(), nn.Linear(20, 5),
    )


def test_norm_like_modules_it_cannot_watch_are_named(recording_logger: RecordingLogger) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TinyModule(odd_net), steps=2, logger=recording_logger, callbacks=[OutlierMonitor()])
    messages = [str(w.message) for w in caught if str(w.message).startswith("OutlierMonitor")]
    (skipped,) = [m for m in messages if "not monitoring these norm layers" in m]
    assert "net.2 (WeirdNorm: no 1-d weight or normalized_shape" in skipped
    assert "net.5 (LayerNorm: its normalized_shape (4, 5) spans 2 dims" in skipped
    assert "PreNorm" not in skipped and "parametriz" not in skipped.lower() and "_WeightNorm" not in skipped
    assert outlier_tags(recording_logger).keys() >= {"z-layers/outlier/net.3.norm/absmax", "outlier/all/absmax"}
    assert not any(tag.startswith(("z-layers/outlier/net.2/", "z-layers/outlier/net.5/")) for tag in outlier_tags(recording_logger))


class ChunkNorm(nn.Module):
    """Named like a norm with a 1-d weight of 4, but fed (N, 12): it normalises 3 chunks of 4 itself."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = x.unflatten(-1, (3, 4))  # (N, 3, 4)
        return (self.weight * chunks / chunks.norm(dim=-1, keepdim=True).clamp_min(1e-6)).flatten(-2)


def chunk_net() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(105, 12), ChunkNorm(), nn.Linear(12, 5))


def test_input_without_the_channel_count_warns_once(recording_logger: RecordingLogger) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TinyModule(chunk_net), steps=3, logger=recording_logger, callbacks=[OutlierMonitor()])
    ours = [str(w.message) for w in caught if "without 4 channels on the last dim or dim 1" in str(w.message)]
    assert len(ours) == 1 and "'net.2' (ChunkNorm)" in ours[0] and "(8, 12)" in ours[0]
    assert not outlier_tags(recording_logger) and recording_logger.history["train/loss"]


def test_model_without_norms_warns_once_logs_nothing(recording_logger: RecordingLogger) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TinyModule(lambda: nn.Sequential(nn.Flatten(), nn.Linear(105, 5))), steps=3, logger=recording_logger,
            callbacks=[OutlierMonitor()])
    assert len([w for w in caught if "no norm layer it can monitor" in str(w.message)]) == 1
    assert not outlier_tags(recording_logger)


def test_tensorboard_layout_shows_every_monitor(tmp_path: Path) -> None:
    tb = TensorBoardLogger(tmp_path, name="tb")
    fit(TinyModule(planted_net), steps=2, logger=tb, callbacks=[GradientHomogeneityMonitor(), OutlierMonitor()])
    steps_of, layout = tensorboard_run(tb.log_dir)
    assert steps_of("z-layers/outlier/net.4.norm/rms_share") == [0, 1]
    assert layout.keys() == {"Phasor homogeneity", "Activation outliers", "Phasor homogeneity: net.1, net.3, net.4.norm",
                             "Activation outliers: net.1, net.3, net.4.norm, net.4.odd_norm"}
    assert {r"^outlier/all/kurtosis$", r"^outlier/all/mrs_share$"} <= set(layout["Activation outliers"])
    assert r"^z-layers/outlier/(net\.1|net\.3|net\.4\.norm|net\.4\.odd_norm)/kurtosis$" in set(
        layout["Activation outliers: net.1, net.3, net.4.norm, net.4.odd_norm"])


def test_state_dict_round_trip() -> None:
    monitor = OutlierMonitor()
    fit(ManualModule(planted_net), steps=6, logger=RecordingLogger(), data=image_data(24), log_every_n_steps=1,
        callbacks=[monitor])
    assert_state_round_trip(monitor, OutlierMonitor(), {"n_logs": 3, "batches": 3})


VALID = r"\['absmax', 'rms_share', 'mrs_share', 'outlier_ratio', 'x2_over_fp16_frac', 'kurtosis', 'nonfinite'\]"


@pytest.mark.parametrize("kwargs,match", [
    ({"log_every_n_steps": 0}, "OutlierMonitor: log_every_n_steps must be None or an int >= 1"),
    ({"figures": ["absmax", "rms"]}, rf"figures=\['absmax', 'rms'\]: \['rms'\] not valid; choose one or more of {VALID}"),
    ({"figures": []}, rf"figures=\[\]: none not valid; choose one or more of {VALID}"),
    ({"figures": "absmax"}, rf"figures must be a list of figure names \(any of {VALID}\), got 'absmax'"),
    ({"include": "("}, "OutlierMonitor: include='\\(' is not a valid regex"),
])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OutlierMonitor(**kwargs)


def run(devices: int, out: str = "") -> dict[str, dict[int, float]]:
    """The global batch split over ranks (planted_net has per-sample norms only)."""
    return split_fit(TinyModule(planted_net), image_data(32), global_batch=GLOBAL_BATCH, devices=devices,
                     strategy="ddp" if devices > 1 else "auto", steps=STEPS, callbacks=[OutlierMonitor()], out=out)


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_ddp_gloo_matches_single_process(tmp_path: Path) -> None:
    tags, single = ddp_matches_single_process(Path(__file__).resolve(), run, tmp_path / "rank0.json", "outlier/",
                                              STEPS, rel=1e-5, abs=1e-7)
    assert {"z-layers/outlier/net.1/outlier_ratio", "z-layers/outlier/net.4.norm/kurtosis", "outlier/all/x2_over_fp16_frac"} <= tags
    assert all(math.isfinite(value) for tag in tags for value in single[tag].values())


if __name__ == "__main__":
    run(devices=2, out=sys.argv[1])
