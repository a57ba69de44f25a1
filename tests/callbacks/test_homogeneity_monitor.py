"""GradientHomogeneityMonitor in real (tiny, CPU) Trainer runs, against autograd references."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from helpers.lightning import ManualModule, TinyModule, fit, image_data, per_sample_net
from helpers.recording_logger import RecordingLogger
from lightning_mrs import MRSNorm2d
from lightning_mrs.callbacks import GradientHomogeneityMonitor
from lightning_mrs.callbacks.tb_layout import HOMOGENEITY

STATS = ("grad_mean", "grad_cv", "grad_max_ratio", "grad_p05", "grad_p50", "grad_p95", "starved_frac",
         "radial_frac", "act_outlier_ratio", "nonfinite")
NORMS = {"net.1": 1, "net.5": 1, "net.10": -1}  # monitored_net's norm layers and their channel dim


class Poison(torch.autograd.Function):
    """Identity forward; backward writes NaN into ``entry`` of the incoming gradient (all of it
    when ``entry`` is None)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, entry: Optional[tuple[int, ...]]) -> torch.Tensor:
        ctx.entry = entry
        return x.clone()  # not a view: an in-place ReLU may follow

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        g[ctx.entry if ctx.entry is not None else ...] = float("nan")
        return g, None


class PoisonAt(nn.Module):
    """Identity; poisons the gradient (see :class:`Poison`) on its first forward call."""

    def __init__(self, entry: Optional[tuple[int, ...]] = (0, 3)) -> None:
        super().__init__()
        self.entry, self.calls = entry, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return Poison.apply(x, self.entry) if self.calls == 1 else x


def monitored_net(after_first: Callable[[], nn.Module] = nn.Identity, after_last: Callable[[], nn.Module] = nn.Identity) -> nn.Sequential:
    """MRSNorm2d, BatchNorm2d (in-place ReLUs after both) and LayerNorm; a slot (identity unless
    given) after the first norm and after the last one."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8), after_first(), nn.ReLU(inplace=True),
        nn.Conv2d(8, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 10), nn.LayerNorm(10), after_last(), nn.Linear(10, 5),
    )


def poisoned_head() -> nn.Sequential:
    return monitored_net(after_last=PoisonAt)


def record(net_fn: Callable[[], nn.Module] = monitored_net, *, module_cls: type = TinyModule,
           monitor: Optional[GradientHomogeneityMonitor] = None, loggers: tuple = (), callbacks: tuple = (),
           **kw: Any) -> RecordingLogger:
    """Fit ``module_cls(net_fn)`` with the monitor; what every logger got."""
    rec = RecordingLogger()
    fit(module_cls(net_fn), logger=[rec, *loggers], callbacks=[monitor or GradientHomogeneityMonitor(), *callbacks], **kw)
    return rec


def reference_figures(x: torch.Tensor, g: torch.Tensor, channel_dim: int, threshold: float = 0.1) -> dict:
    """The figures from the definitions, in float64 numpy (independent of lightning_mrs.stats)."""
    c = x.shape[channel_dim]
    xs = x.double().movedim(channel_dim, -1).reshape(-1, c // 2, 2).numpy()  # (n, P, 2)
    gs = g.double().movedim(channel_dim, -1).reshape(-1, c // 2, 2).numpy()
    energy = (gs**2).sum(-1)  # (n, P)
    big_g = np.sqrt(energy.mean(0))  # (P,)
    r = np.linalg.norm(xs, axis=-1)  # (n, P)
    radial = ((gs * xs).sum(-1) / np.where(r > 0, r, 1)) ** 2
    act = r.mean(0)
    med = np.median(big_g)
    return {
        "G": big_g, "grad_mean": big_g.mean(), "grad_cv": big_g.std() / big_g.mean(),
        "grad_max_ratio": big_g.max() / med, "grad_p05": np.quantile(big_g, 0.05), "grad_p50": med,
        "grad_p95": np.quantile(big_g, 0.95), "starved_frac": np.mean(big_g < threshold * med),
        "radial_frac": radial.sum() / energy.sum(), "act_outlier_ratio": act.max() / act.mean(),
        "nonfinite": 0.0,
    }


def autograd_reference(net_fn: Callable[[], nn.Module] = monitored_net, batch_size: int = 8):
    """Step 0 by hand on a fresh copy of the model (seeded as TinyModule seeds it): each norm's
    ``(input, input gradient)`` by retain_grad, and the net."""
    torch.manual_seed(0)
    net = net_fn()
    captured: dict[str, torch.Tensor] = {}
    for name in NORMS:
        def hook(module: nn.Module, args: tuple, name: str = name) -> None:
            args[0].retain_grad()
            captured[name] = args[0]
        net.get_submodule(name[len("net."):]).register_forward_pre_hook(hook)
    x, y = image_data()[:batch_size]
    nn.functional.cross_entropy(net(x), y).backward()
    return {name: (t.detach(), t.grad) for name, t in captured.items()}, net


def value(rec: RecordingLogger, layer: str, stat: str, step: int = 0) -> float:
    return rec.history[HOMOGENEITY.tag(layer, stat)][step]


@pytest.mark.parametrize("module_cls", [TinyModule, ManualModule])
def test_fp32_figures_match_autograd_reference(module_cls: type) -> None:
    rec = record(module_cls=module_cls, steps=1 if module_cls is TinyModule else 2)
    captured, net = autograd_reference()
    ref = {name: reference_figures(x, g, NORMS[name]) for name, (x, g) in captured.items()}
    for layer, figures in ref.items():  # MRSNorm2d, BatchNorm2d and LayerNorm alike
        for stat in STATS:
            assert value(rec, layer, stat) == pytest.approx(figures[stat], rel=1e-4, abs=1e-9), (layer, stat)
    assert value(rec, "net.1", "wgrad_mean") == pytest.approx(net[1].weight.grad.abs().mean().item(), rel=1e-5)
    assert value(rec, "all", "grad_mean") == pytest.approx(np.mean([f["grad_mean"] for f in ref.values()]), rel=1e-4)
    assert value(rec, "all", "overflow_skipped") == 0.0
    assert value(rec, "all", "layers") == 3.0


def test_all_nonfinite_layer_logs_only_its_count() -> None:
    """Every input-gradient entry of the MRSNorm2d is NaN: no figure of it, no part in phasor/all."""
    net_fn = lambda: monitored_net(after_first=lambda: PoisonAt(entry=None))  # noqa: E731
    rec = record(net_fn, steps=1, monitor=GradientHomogeneityMonitor(on_nonfinite="ignore"))
    captured, net = autograd_reference(net_fn)
    x, g = captured["net.1"]
    assert not g.isfinite().any()
    assert {t for t in rec.history if t.startswith("z-layers/phasor/net.1/")} == {"z-layers/phasor/net.1/nonfinite"}
    assert value(rec, "net.1", "nonfinite") == g.numel() + net[1].weight.numel()  # input and weight gradients
    ref = {name: reference_figures(x, g, NORMS[name]) for name, (x, g) in captured.items() if name != "net.1"}
    assert value(rec, "all", "layers") == 2.0
    assert value(rec, "all", "nonfinite") == value(rec, "net.1", "nonfinite")
    for stat in ("grad_mean", "grad_cv", "radial_frac"):
        assert value(rec, "all", stat) == pytest.approx(np.mean([f[stat] for f in ref.values()]), rel=1e-4), stat
    assert value(rec, "all", "grad_cv_max") == pytest.approx(max(f["grad_cv"] for f in ref.values()), rel=1e-4)


def test_gradient_through_the_layer_only() -> None:
    """A residual branch sharing the norm's input must not leak into that layer's figures."""

    class Residual(nn.Module):
        def __init__(self, detach: bool = False) -> None:
            super().__init__()
            self.conv, self.norm, self.detach = nn.Conv2d(3, 8, 3, padding=1), MRSNorm2d(8), detach
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.conv(x)
            skip = h.detach() if self.detach else h
            return self.head(self.norm(h) + 3.0 * skip)

    rec = record(Residual, steps=1)
    torch.manual_seed(0)
    ref_net = Residual(detach=True)  # same values; the only gradient into h is the norm's
    captured = {}
    ref_net.norm.register_forward_pre_hook(lambda m, a: (a[0].retain_grad(), captured.setdefault("h", a[0])) and None)
    x, y = image_data()[:8]
    nn.functional.cross_entropy(ref_net(x), y).backward()
    ref = reference_figures(captured["h"].detach(), captured["h"].grad, 1)
    for stat in ("grad_mean", "grad_cv", "radial_frac"):
        assert value(rec, "net.norm", stat) == pytest.approx(ref[stat], rel=1e-4), stat


def test_norm_on_the_raw_input_is_monitored() -> None:
    """The input of a first-layer norm needs no gradient for training; the monitor still gets it."""

    class Pad(nn.Module):  # 3 data channels + a constant one: the norm sees an even count
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(torch.cat([x, torch.ones_like(x[:, :1])], dim=1))

    rec = record(Pad, steps=1)
    torch.manual_seed(0)
    ref_net = Pad()
    x, y = image_data()[:8]
    x4 = torch.cat([x, torch.ones_like(x[:, :1])], dim=1).requires_grad_()
    nn.functional.cross_entropy(ref_net.body(x4), y).backward()
    ref = reference_figures(x4.detach(), x4.grad, 1)
    for stat in ("grad_mean", "grad_cv", "radial_frac", "act_outlier_ratio"):
        assert value(rec, "net.body.0", stat) == pytest.approx(ref[stat], rel=1e-4), stat


def test_hooks_only_on_logging_steps() -> None:
    seen: dict[int, tuple[int, int]] = {}

    class Probe(pl.Callback):  # runs after the monitor in every hook
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.start = sum(len(m._forward_pre_hooks) for m in pl_module.modules())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen[trainer.global_step - 1] = (self.start, sum(len(m._forward_pre_hooks) for m in pl_module.modules()))

    rec = record(steps=5, monitor=GradientHomogeneityMonitor(log_every_n_steps=3), callbacks=(Probe(),))
    assert sorted(rec.history["phasor/all/grad_cv"]) == [2]  # (step + 1) % 3 == 0, like Lightning
    assert seen == {0: (0, 0), 1: (0, 0), 2: (3, 0), 3: (0, 0), 4: (0, 0)}


def test_trainer_interval_is_the_default() -> None:
    rec = record(steps=4, log_every_n_steps=2)
    assert sorted(rec.history["z-layers/phasor/net.5/grad_cv"]) == sorted(rec.history["train/loss"]) == [1, 3]


def fp16_plugin(**scaler_kw: Any) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kw))


@pytest.mark.parametrize("precision", ["16-mixed+GradScaler", "bf16-mixed"])
def test_mixed_precision_matches_fp32(precision: str) -> None:
    fp32 = record(steps=3)
    if precision == "bf16-mixed":
        mixed, rtol = record(steps=3, precision="bf16-mixed"), 0.05
    else:
        mixed, rtol = record(steps=3, plugins=[fp16_plugin()]), 0.02
        assert mixed.history["phasor/all/loss_scale"][0] == 2.0**16  # the figures were unscaled
    for layer in [*NORMS, "all"]:
        for step in range(3):
            for stat in ("grad_mean", "grad_p50"):
                if layer == "all" and stat == "grad_p50":
                    continue
                assert value(mixed, layer, stat, step) == pytest.approx(value(fp32, layer, stat, step), rel=rtol)
            assert value(mixed, layer, "grad_cv", step) == pytest.approx(value(fp32, layer, "grad_cv", step), abs=0.02)
        assert mixed.history[HOMOGENEITY.tag(layer, "nonfinite")] == {0: 0.0, 1: 0.0, 2: 0.0}
    wtol = 0.05 if precision.startswith("16") else 0.15  # a sum with cancellations: bf16 has 8 bits
    for step in range(3):  # the MRS weight gradient too (Lightning unscales it before the hook)
        assert value(mixed, "net.1", "wgrad_mean", step) == pytest.approx(value(fp32, "net.1", "wgrad_mean", step), rel=wtol)


def test_overflow_skipped_step_is_reported_not_raised() -> None:
    # a scale of 2^40 overflows the fp16 backward: the scaler skips step 0 and backs off to 2^10
    plugin = fp16_plugin(init_scale=2.0**40, backoff_factor=2.0**-30)
    monitor = GradientHomogeneityMonitor(on_nonfinite="raise")
    rec = record(steps=2, plugins=[plugin], monitor=monitor)
    assert rec.history["phasor/all/overflow_skipped"] == {0: 1.0, 1: 0.0}
    assert rec.history["phasor/all/loss_scale"] == {0: 2.0**40, 1: 2.0**10}
    assert rec.history["phasor/all/nonfinite"][0] > 0 and rec.history["phasor/all/nonfinite"][1] == 0
    assert sorted(rec.history["phasor/all/grad_cv"]) == [1]  # the skipped step's figures are not logged
    assert monitor.overflow_skipped_total == 1


@pytest.mark.parametrize("on_nonfinite", ["warn", "raise", "ignore"])
def test_nan_injection(on_nonfinite: str) -> None:
    monitor = GradientHomogeneityMonitor(on_nonfinite=on_nonfinite)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if on_nonfinite == "raise":
            # raised after logging, on the first step with NaN, naming the layers and counts
            with pytest.raises(RuntimeError, match=r"NaN/Inf gradient entries at step 0 in 3 norm layer.*net\.10: 10\)"):
                record(poisoned_head, steps=2, monitor=monitor)
            return
        rec = record(poisoned_head, steps=2, monitor=monitor)
    ours = [str(w.message) for w in caught if "NaN/Inf gradient entries" in str(w.message)]
    # step 0 poisoned; its NaN gradients make the weights NaN, so step 1 is NaN throughout
    assert len(ours) == (2 if on_nonfinite == "warn" else 0)
    # NaN in one entry of the LayerNorm's output gradient makes that sample's whole input
    # gradient row NaN (10 channels); BatchNorm then spreads it over every entry before it
    assert value(rec, "net.10", "nonfinite") == 10
    assert value(rec, "net.5", "nonfinite") == 8 * 6 * 7 * 5
    captured, net = autograd_reference(poisoned_head)
    count = {name: (~g.isfinite()).sum().item() for name, (_, g) in captured.items()}
    assert count["net.10"] == 10 and count["net.5"] == 8 * 6 * 7 * 5
    # before the BatchNorm: ReLU masks and conv spreads the NaN; count what autograd made
    w_nonfinite = (~net[1].weight.grad.isfinite()).sum().item()
    assert value(rec, "net.1", "nonfinite") == count["net.1"] + w_nonfinite
    assert value(rec, "all", "nonfinite") == sum(count.values()) + w_nonfinite
    # the other figures of the poisoned step come from the finite entries and stay finite
    for tag in rec.steps("phasor/"):
        assert all(math.isfinite(v) for v in rec.history[tag].values()), tag


def test_gradient_accumulation_sums_micro_batches() -> None:
    whole = record(per_sample_net, steps=2, batch_size=8)
    accumulated = record(per_sample_net, steps=2, batch_size=4, accumulate_grad_batches=2)
    assert whole.steps("phasor/") == accumulated.steps("phasor/")
    assert whole.steps("phasor/")["z-layers/phasor/net.1/grad_mean"] == [0, 1]
    for tag, steps in whole.steps("phasor/").items():
        for step in steps:
            v = whole.history[tag][step]
            assert accumulated.history[tag][step] == pytest.approx(v, rel=1e-4, abs=1e-9), (tag, step)


def test_tensorboard_and_csv_loggers(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    tb = TensorBoardLogger(tmp_path, name="tb")
    csv = CSVLogger(tmp_path, name="csv")
    record(steps=3, loggers=(tb, csv), monitor=GradientHomogeneityMonitor(histogram_every_n_logs=2))
    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    for layer in [*NORMS, "all"]:
        for stat in ("grad_mean", "grad_cv", "starved_frac", "nonfinite"):
            events = acc.Scalars(HOMOGENEITY.tag(layer, stat))
            assert [e.step for e in events] == [0, 1, 2]
            assert all(math.isfinite(e.value) for e in events)
    for layer in NORMS:
        hist = acc.Histograms(HOMOGENEITY.tag(layer, "G"))
        assert [h.step for h in hist] == [0, 2]  # every 2nd log
        assert all(math.isfinite(h.histogram_value.sum) for h in hist)
    assert tags["tensors"] == ["custom_scalars__config__"]
    (event,) = acc.Tensors("custom_scalars__config__")  # written once
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    category, block = layout.category  # the summaries, then the charts of one block of (here all 3) layers
    assert category.title == "Phasor homogeneity" and block.title == f"Phasor homogeneity: {', '.join(NORMS)}"
    names = "|".join(n.replace(".", r"\.") for n in NORMS)
    assert {t for c in block.chart for t in c.multiline.tag} >= {rf"^z-layers/phasor/({names})/grad_cv$",
                                                               rf"^z-layers/phasor/({names})/starved_frac$"}
    margins = {c.title: c.margin.series[0] for c in category.chart if c.HasField("margin")}
    assert len(margins) == 3
    series = margins["G_i of net.5: median, 5-95 % band"]
    assert (series.value, series.lower, series.upper) == (
        "z-layers/phasor/net.5/grad_p50", "z-layers/phasor/net.5/grad_p05", "z-layers/phasor/net.5/grad_p95")
    multiline = [t for c in category.chart if c.HasField("multiline") for t in c.multiline.tag]
    assert r"^phasor/all/grad_cv$" in multiline and r"^phasor/all/starved_frac$" in multiline
    assert r"^phasor/all/nonfinite$" in multiline
    # other loggers get the scalars through log_metrics
    import csv as csv_mod

    with open(f"{csv.log_dir}/metrics.csv") as f:
        rows = [r for r in csv_mod.DictReader(f) if r["z-layers/phasor/net.1/grad_cv"]]  # not self.log's rows
    assert [float(r["z-layers/phasor/net.1/grad_cv"]) for r in rows] == pytest.approx(
        [e.value for e in acc.Scalars("z-layers/phasor/net.1/grad_cv")], rel=1e-6)


def test_include_filter_and_odd_layers_are_reported() -> None:
    def net() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 7, 3), nn.BatchNorm2d(7), nn.Conv2d(7, 6, 1), nn.BatchNorm2d(6),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5))

    with pytest.warns(UserWarning, match=r"not monitoring these norm layers: net\.1 \(BatchNorm2d: 7 channels"):
        rec = record(net, steps=1)
    assert "z-layers/phasor/net.3/grad_cv" in rec.history and not any("net.1/" in t for t in rec.history)
    rec = record(steps=1, monitor=GradientHomogeneityMonitor(include=r"\.(1|10)$"))
    assert {t.split("/")[-2] for t in rec.steps("phasor/")} == {"net.1", "net.10", "all"}


def test_state_dict_round_trip() -> None:
    monitor = GradientHomogeneityMonitor(on_nonfinite="ignore")
    record(poisoned_head, module_cls=ManualModule, steps=4, monitor=monitor)
    state = monitor.state_dict()
    assert state["n_logs"] == 2 and state["nonfinite_total"] > 0 and state["batches"] == 2
    fresh = GradientHomogeneityMonitor()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"log_every_n_steps": 0}, "log_every_n_steps must be None"),
        ({"starved_threshold": 1.5}, r"starved_threshold must lie in \(0, 1\)"),
        ({"histogram_every_n_logs": -1}, "histogram_every_n_logs must be an int >= 0"),
        ({"on_nonfinite": "crash"}, r"choose one of \['warn', 'raise', 'ignore'\]"),
        ({"include": "("}, "not a valid regex"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GradientHomogeneityMonitor(**kwargs)
