"""AttentionMonitor in real (tiny, CPU) Trainer runs, against a float64 softmax built from the
layers' own weights.

Run as a script (``python tests/callbacks/test_attention_monitor.py OUT.json``) this file is
also the 2-process gloo ``ddp`` job of :func:`test_ddp_gloo_matches_single_process`: rank 0
writes what it logged to ``OUT.json``.
"""

from __future__ import annotations

import math
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader

from helpers.ddp import ddp_matches_single_process, split_fit
from helpers.lightning import ManualModule, TinyModule, conv_net, fit, image_data
from helpers.recording_logger import RecordingLogger, monitor_tag
from helpers.reference import attention_ref, mrs_norm_ref
from lightning_mrs import expose_attention, swap_norms
from lightning_mrs.callbacks import AttentionMonitor, GradientHomogeneityMonitor

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

FIGURES = ("logit_max", "entropy_mean", "entropy_min", "collapsed_frac")
NORM_FIGURES = ("q_norm_mean", "k_norm_mean")
SIZE, BATCH = (8, 8), 8  # 4 patches of 4x4 + a class token: N = 5 queries per sample
GLOBAL_BATCH, STEPS = 8, 2


def hot(qk: torch.Tensor, factor: float) -> None:
    """Scale the q and k rows of a fused in-projection weight (3C, C): peaky softmax rows."""
    with torch.no_grad():
        qk[: 2 * qk.shape[1]] *= factor


def timm_vit(qk_norm: Optional[str] = None) -> nn.Module:
    net = timm.create_model("vit_tiny_patch16_224", img_size=SIZE, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                            num_classes=5)
    for block in net.blocks:
        hot(block.attn.qkv.weight, 60.0)
    if qk_norm is not None:
        swap_norms(net, None, qk_norm=qk_norm)
        for block in net.blocks:  # weights away from 1, so that they matter
            for norm in (block.attn.q_norm, block.attn.k_norm):
                nn.init.uniform_(norm.weight, 0.5, 3.0)
    return net


def timm_vit_mrs() -> nn.Module:
    return timm_vit("mrs")


def tv_vit() -> nn.Module:
    net = torchvision.models.VisionTransformer(SIZE[0], 4, 2, 2, 16, 32, num_classes=5)
    for layer in net.encoder.layers:
        hot(layer.self_attention.in_proj_weight, 15.0)
    expose_attention(net)
    return net


def qk_from_weights(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-head q, k (B, H, N, D) in float64 from the layer's input and its own weights, after its
    QK-norm (by the independent MRS reference), and the logit scale 1/sqrt(D)."""
    if isinstance(attn, nn.MultiheadAttention):
        weight, bias, heads = attn.in_proj_weight, attn.in_proj_bias, attn.num_heads
    else:
        weight, bias, heads = attn.qkv.weight, attn.qkv.bias, attn.num_heads
    c = x.shape[-1]
    qkv = x.double() @ weight.double().T + bias.double()  # (B, N, 3C)
    q, k = (qkv[..., i * c:(i + 1) * c].unflatten(-1, (heads, c // heads)).transpose(1, 2) for i in range(2))
    norms = [getattr(attn, "q_norm", nn.Identity()), getattr(attn, "k_norm", nn.Identity())]
    q, k = (mrs_norm_ref(t, n.weight, n.eps) if hasattr(n, "num_phasors") else t for t, n in zip((q, k), norms))
    return q, k, (c // heads) ** -0.5


def reference(net_fn: Callable[[], nn.Module], pairs: Optional[list[tuple[int, int]]] = None,
              ) -> dict[str, dict[str, float]]:
    """Step 0 by hand on a fresh copy of the model (seeded as TinyModule seeds it): each attention
    layer's input by a forward pre-hook, then the softmax of the queries ``pairs`` (all: None)."""
    torch.manual_seed(0)
    net = net_fn()
    inputs: dict[str, torch.Tensor] = {}
    attns = {name: m for name, m in net.named_modules()
             if isinstance(m, nn.MultiheadAttention) or type(m).__name__ == "Attention"}

    def keep(name: str, module: nn.Module, args: tuple) -> None:
        inputs[name] = args[0].detach()

    for name, module in attns.items():
        module.register_forward_pre_hook(partial(keep, name))
    x, _ = image_data(BATCH, SIZE)[:BATCH]
    net(x)
    out = {}
    for name, module in attns.items():
        q, k, scale = qk_from_weights(module, inputs[name])
        out[f"net.{name}"] = attention_ref(q, k, scale, pairs)
    return out


def attention_tags(rec: RecordingLogger) -> dict[str, dict[int, float]]:
    return {tag: series for tag, series in rec.history.items() if monitor_tag(tag, "attention/")}


def check(got: dict[str, dict[int, float]], ref: dict[str, dict[str, float]], step: int = 0, *, norms: bool) -> None:
    for layer, figures in ref.items():
        for stat in FIGURES + (NORM_FIGURES if norms else ()):
            expected = pytest.approx(figures[stat], rel=1e-4, abs=1e-5)
            assert got[f"z-layers/attention/{layer}/{stat}"][step] == expected, (layer, stat)
        if not norms:
            assert f"z-layers/attention/{layer}/q_norm_mean" not in got
    assert got["attention/all/logit_max"][step] == pytest.approx(max(f["logit_max"] for f in ref.values()), rel=1e-4)
    assert got["attention/all/collapsed_frac"][step] == pytest.approx(max(f["collapsed_frac"] for f in ref.values()))
    assert got["attention/all/entropy_mean"][step] == pytest.approx(
        sum(f["entropy_mean"] for f in ref.values()) / len(ref), rel=1e-4)


# (net, max_queries, sampled (sample, position) pairs: the documented rule worked out by hand)
CASES = {
    "timm_identity": (timm_vit, None, None),
    "timm_mrs_qk_norm": (timm_vit_mrs, None, None),
    "torchvision_exposed": (tv_vit, None, None),
    # 8 samples x 2 positions (20 // 8), the j-th shifted by j: (0 or 2) + j mod 5
    "timm_20_queries": (timm_vit, 20, [(j, (i + j) % 5) for j in range(8) for i in (0, 2)]),
    # 3 samples (j * 8 // 3), one position each (j)
    "torchvision_3_queries": (tv_vit, 3, [(0, 0), (2, 1), (5, 2)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_figures_match_materialised_softmax(case: str, recording_logger: RecordingLogger) -> None:
    net_fn, max_queries, pairs = CASES[case]
    fit(TinyModule(net_fn), steps=1, logger=recording_logger, data=image_data(BATCH, SIZE), batch_size=BATCH,
        callbacks=[AttentionMonitor(max_queries=max_queries)])
    ref = reference(net_fn, pairs)
    assert len(ref) == 2 and 0 < max(f["collapsed_frac"] for f in ref.values()) < 1  # some rows collapse, not all
    check(attention_tags(recording_logger), ref, norms=net_fn is timm_vit_mrs)
    if pairs is not None:  # the sample matters: all queries give other figures
        full = reference(net_fn)
        assert any(abs(full[layer]["entropy_mean"] - ref[layer]["entropy_mean"]) > 1e-3 for layer in ref)


def real_layer(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A timm layer of each q/k layout the monitor handles, and an input that makes its softmax
    peaky (5x unit tokens)."""
    from timm.layers import AttentionRope, DiffAttention
    from timm.models.vision_transformer import ParallelScalingBlock
    from timm.models.vision_transformer_sam import Attention as SamAttention

    tokens = 5.0 * torch.randn(3, 7, 16)  # (B, N, C)
    if kind == "sam_(BH)ND":
        return SamAttention(16, num_heads=2), tokens[:, :6].reshape(3, 2, 3, 16)  # (B, H, W, C) input
    layer = {"parallel_BNHD": lambda: ParallelScalingBlock(16, 2),
             "diff_2H_softmaxes": lambda: DiffAttention(16, num_heads=2),
             "grouped_query": lambda: AttentionRope(16, num_heads=4, num_kv_heads=2, qkv_fused=False)}[kind]()
    if kind == "parallel_BNHD":  # its input is layer-normed: scale the projection instead
        with torch.no_grad():
            layer.in_proj.weight *= 20.0
    return layer, tokens


@pytest.mark.parametrize("kind", ["parallel_BNHD", "sam_(BH)ND", "diff_2H_softmaxes", "grouped_query"])
def test_real_layers_figures_match_their_own_softmax(kind: str) -> None:
    """The weights each layer's unfused path computes (seen by a hook on its attn_drop) against
    the monitor's capture of the same forward: the layout, head and key-head handling."""
    from lightning_mrs import iter_attention_layers
    from lightning_mrs.attention_stats import FIGURES as TABLE
    from lightning_mrs.callbacks.attention_report import AttentionCapture, WatchedLayer, figures_of
    from lightning_mrs.callbacks.capture import layer_metrics
    from lightning_mrs.callbacks.tb_layout import ATTENTION

    layer, x = real_layer(kind)
    layer.fused_attn = False
    seen: list[torch.Tensor] = []
    layer.attn_drop.register_forward_hook(lambda m, args, out: seen.append(out.detach().double()))
    (found,) = [WatchedLayer(name, module, info) for name, module, info in iter_attention_layers(layer)]
    capture = AttentionCapture([found], step=0, device=torch.device("cpu"), max_queries=None)
    capture.arm()
    with torch.no_grad():
        layer(x)
    capture.disarm()
    got = layer_metrics(ATTENTION.tag, [found], capture.sums, TABLE, "queries", figures_of)
    (weights,) = seen  # (B, H, N, N); SAM: (B*H, N, N)
    weights = weights.reshape(x.shape[0], found.info.num_heads, *weights.shape[-2:])
    entropy = torch.special.entr(weights).sum(-1)  # (B, H, N)
    ref = {"entropy_mean": entropy.mean().item(), "entropy_min": entropy.mean(dim=(0, 2)).min().item(),
           "collapsed_frac": (weights.amax(-1) > 0.99).double().mean().item()}
    assert 0 < ref["collapsed_frac"] < 1
    for stat, value in ref.items():
        assert got[f"z-layers/attention/root/{stat}"] == pytest.approx(value, rel=1e-4, abs=1e-5), stat


@pytest.mark.parametrize("module_cls,interval,kw", [
    (TinyModule, 2, {}),
    (TinyModule, 1, {"accumulate_grad_batches": 2}),  # 5 batches an epoch: the odd last one steps alone
    (ManualModule, 2, {}),  # two optimizers: global_step advances by 2 a batch
])
def test_logging_steps_line_up_with_train_loss(recording_logger: RecordingLogger,
                                               module_cls: type, interval: int, kw: dict) -> None:
    steps = 5 if module_cls is TinyModule else 10
    fit(module_cls(timm_vit), steps=steps, logger=recording_logger, log_every_n_steps=interval,
             data=image_data(40, SIZE), callbacks=[AttentionMonitor(max_queries=None)], **kw)
    expected = list(range(interval - 1, 5, interval))
    assert sorted(recording_logger.history["train/loss"]) == expected
    tags = attention_tags(recording_logger)
    assert {"z-layers/attention/net.blocks.0.attn/logit_max", "attention/all/entropy_min"} <= tags.keys()
    assert all(sorted(series) == expected for series in tags.values()), tags


def test_accumulated_micro_batches_add_up() -> None:
    logs = []
    for batch_size, accumulate in ((8, 1), (4, 2)):
        rec = RecordingLogger()
        fit(TinyModule(timm_vit), steps=2, logger=rec, data=image_data(32, SIZE), batch_size=batch_size,
            accumulate_grad_batches=accumulate, callbacks=[AttentionMonitor(max_queries=None)])
        logs.append(attention_tags(rec))
    whole, accumulated = logs
    assert whole.keys() == accumulated.keys()
    for tag, series in whole.items():
        assert accumulated[tag] == pytest.approx(series, rel=1e-4, abs=1e-6), tag


class WithValidation(TinyModule):
    """Validation on inputs 30 times larger: captured, they would change every figure."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0] * 30.0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(image_data(8, SIZE, seed=2), batch_size=4)


def hooks_on(module: nn.Module) -> int:
    return len(module.q_norm._forward_hooks) + len(module.k_norm._forward_hooks)


class BackwardProbe(pl.Callback):
    """After the monitor: the hooks on the first block's q_norm/k_norm when backward starts."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.seen.append(hooks_on(pl_module.net.blocks[0].attn))


def test_nothing_captured_between_logging_steps_or_in_validation() -> None:
    calls: list[tuple[str, int, int]] = []  # (stage, global step, hooks on q_norm/k_norm) per attention call
    runs = []
    for module_cls in (TinyModule, WithValidation):
        module = module_cls(timm_vit)
        attn = module.net.blocks[0].attn
        attn.register_forward_pre_hook(lambda m, args: calls.append(
            ("train" if module.trainer.training else "val", module.trainer.global_step, hooks_on(m))))
        rec, probe = RecordingLogger(), BackwardProbe()
        calls.clear()
        fit(module, steps=4, logger=rec, data=image_data(32, SIZE), log_every_n_steps=2, val_check_interval=1,
            num_sanity_val_steps=1, callbacks=[AttentionMonitor(max_queries=None), probe])
        runs.append(attention_tags(rec))
        assert probe.seen == [0, 0, 0, 0]  # removed right after the training forward
    assert {c for c in calls if c[0] == "train"} == {("train", 0, 0), ("train", 1, 2), ("train", 2, 0), ("train", 3, 2)}
    assert {c for c in calls if c[0] == "val"} == {("val", s, 0) for s in (0, 1, 2, 3, 4)}  # sanity check at 0
    plain, validated = runs
    assert plain == validated  # validation forwards left no trace
    assert sorted(plain["attention/all/logit_max"]) == [1, 3]


def test_bf16_mixed_matches_fp32() -> None:
    """Under autocast q and k arrive in bf16; the figures are those of fp32 up to bf16 rounding."""
    logs = []
    for precision in ("32-true", "bf16-mixed"):
        rec = RecordingLogger()
        fit(TinyModule(timm_vit_mrs), steps=2, logger=rec, data=image_data(16, SIZE), precision=precision,
            callbacks=[AttentionMonitor()])
        logs.append(attention_tags(rec))
    fp32, bf16 = logs
    assert fp32.keys() == bf16.keys() and len(fp32) == 3 * 6
    for tag, series in fp32.items():
        tol = dict(abs=0.05) if tag.endswith("collapsed_frac") else dict(rel=0.05, abs=0.01)
        assert bf16[tag] == pytest.approx(series, **tol), tag


class SumOnlyStrategy:
    """Two ranks' values, a reduce that sums only (as XLA's), and an all_gather."""

    def __init__(self, *ranks: torch.Tensor) -> None:
        self.ranks = ranks

    def reduce(self, flat: torch.Tensor, reduce_op: Any = "mean") -> torch.Tensor:
        if reduce_op != "sum":
            raise ValueError(f"reduce_op {reduce_op} is not supported")
        return sum(self.ranks)

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.ranks)  # (world, n)


def test_max_over_ranks_without_a_max_reduce() -> None:
    from lightning_mrs.callbacks.capture import reduce_over_ranks as _reduce

    strategy = SumOnlyStrategy(torch.tensor([1.0, 5.0, 2.0]), torch.tensor([3.0, 4.0, 2.5]))
    assert _reduce(strategy, torch.zeros(3), "max").tolist() == [3.0, 5.0, 2.5]
    assert _reduce(strategy, torch.zeros(3), "sum").tolist() == [4.0, 9.0, 4.5]


def test_model_without_attention_warns_once_logs_nothing(recording_logger: RecordingLogger) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TinyModule(conv_net), steps=3, logger=recording_logger, callbacks=[AttentionMonitor()])
    ours = [w for w in caught if "no attention layer it can monitor" in str(w.message)]
    assert len(ours) == 1
    assert not attention_tags(recording_logger) and recording_logger.history["train/loss"]


def swin(v2: bool) -> nn.Module:
    from torchvision.models import swin_transformer as tv_swin

    extra = dict(block=tv_swin.SwinTransformerBlockV2, downsample_layer=tv_swin.PatchMergingV2) if v2 else {}
    net = tv_swin.SwinTransformer([2, 2], 8, [2], [2], [2, 2], num_classes=5, **extra)
    expose_attention(net)
    return net


@pytest.mark.parametrize("v2", [False, True])
def test_layers_it_cannot_see_fully_are_named(recording_logger: RecordingLogger, v2: bool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TinyModule(lambda: swin(v2)), steps=1, logger=recording_logger, data=image_data(8, SIZE),
            callbacks=[AttentionMonitor()])
    messages = [str(w.message) for w in caught if str(w.message).startswith("AttentionMonitor")]
    if v2:  # learned per-head logit scale: skipped, and then nothing is left
        assert any("not monitoring" in m and "net.features.1.0.attn" in m and "learned per head" in m for m in messages)
        assert not attention_tags(recording_logger)
    else:  # logged, with a warning that the relative position bias is not in the figures
        assert any("relative position bias" in m and "net.features.1.0.attn" in m for m in messages)
        assert "z-layers/attention/net.features.1.0.attn/entropy_mean" in attention_tags(recording_logger)


def test_tensorboard_layout_shows_both_monitors(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    tb = TensorBoardLogger(tmp_path, name="tb")
    fit(TinyModule(timm_vit), steps=2, logger=tb, data=image_data(16, SIZE),
        callbacks=[GradientHomogeneityMonitor(), AttentionMonitor()])
    acc = EventAccumulator(tb.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("z-layers/attention/net.blocks.1.attn/collapsed_frac")] == [0, 1]
    last = acc.Tensors("custom_scalars__config__")[-1]  # TensorBoard shows the last layout of a run
    layout = layout_pb2.Layout.FromString(last.tensor_proto.string_val[0])
    categories = {c.title: c for c in layout.category}
    assert {"Phasor homogeneity", "Attention"} <= categories.keys()
    tags = [t for c in categories["Attention"].chart for t in c.multiline.tag]
    assert r"^attention/all/logit_max$" in tags and r"^attention/all/k_norm_mean$" in tags
    blocks = [c for title, c in categories.items() if title.startswith("Attention: ")]
    assert [c.title for c in blocks] == ["Attention: net.blocks.0.attn, net.blocks.1.attn"]
    tags = [t for c in blocks[0].chart for t in c.multiline.tag]
    assert r"^z-layers/attention/(net\.blocks\.0\.attn|net\.blocks\.1\.attn)/logit_max$" in tags


def test_state_dict_round_trip() -> None:
    monitor = AttentionMonitor()
    fit(ManualModule(timm_vit), steps=6, logger=RecordingLogger(), data=image_data(24, SIZE), log_every_n_steps=1,
        callbacks=[monitor])
    state = monitor.state_dict()
    assert state == {"n_logs": 3, "batches": 3}
    fresh = AttentionMonitor()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and fresh.n_logs == 3


@pytest.mark.parametrize("kwargs,match", [
    ({"log_every_n_steps": 0}, "log_every_n_steps must be None or an int >= 1"),
    ({"max_queries": 0}, "max_queries must be None or an int >= 1"),
    ({"max_queries": 2.5}, "max_queries must be None or an int >= 1"),
    ({"collapse_threshold": 1.0}, r"collapse_threshold must lie in \(0, 1\)"),
    ({"include": "("}, "not a valid regex"),
])
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AttentionMonitor(**kwargs)


def run(devices: int, out: str = "") -> dict[str, dict[int, float]]:
    """The global batch split over ranks (the ViT has per-token norms only)."""
    return split_fit(TinyModule(timm_vit_mrs), image_data(32, SIZE), global_batch=GLOBAL_BATCH, devices=devices,
                     strategy="ddp" if devices > 1 else "auto", steps=STEPS,
                     callbacks=[AttentionMonitor(max_queries=None)], out=out)


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_ddp_gloo_matches_single_process(tmp_path: Path) -> None:
    tags, single = ddp_matches_single_process(Path(__file__).resolve(), run, tmp_path / "rank0.json", "attention/",
                                              STEPS, rel=1e-5, abs=1e-6)
    assert {"z-layers/attention/net.blocks.0.attn/entropy_min", "attention/all/logit_max", "attention/all/q_norm_mean"} <= tags
    assert all(math.isfinite(value) for tag in tags for value in single[tag].values())


if __name__ == "__main__":
    run(devices=2, out=sys.argv[1])
