"""NormSwap with attention QK-norms: what the checkpoint records, restore and resume.

A QK-norm may be *added* (a fresh timm ViT has ``nn.Identity`` there), so the record must
say where, and ``NormSwap.restore`` must add it again before loading the weights.
"""

from __future__ import annotations

import re

import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from helpers.lightning import TinyModule, assert_same_model, fit, image_data, normswap_record
from lightning_mrs import MRSNorm
from lightning_mrs.callbacks import NormSwap
from lightning_mrs.swap import iter_attention_layers

X = image_data(4, size=(8, 8), seed=7).tensors[0]  # (4, 3, 8, 8)
QK = "mrs(channels-last, eps=1e-06)"


def vit() -> nn.Module:
    timm = pytest.importorskip("timm")  # the floors' environment (.ci/floors) has no timm

    # 2 blocks of 2 heads, head_dim 8: tiny, with Identity q_norm/k_norm
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=8, patch_size=4, embed_dim=16,
                             depth=2, num_heads=2, num_classes=5)


def _fit(callbacks, steps=2, **kw):
    return fit(TinyModule(vit), steps=steps, callbacks=callbacks, data=image_data(16, size=(8, 8)), **kw)


@pytest.mark.parametrize("target", [None, "mrs"])
def test_added_qk_norms_are_recorded_restored_and_resumed(tmp_path, target):
    trainer, trained = _fit([NormSwap(target, qk_norm="mrs")])
    assert [info.qk_norm for _, _, info in iter_attention_layers(trained)] == ["mrs", "mrs"]
    path = tmp_path / "qk.ckpt"
    trainer.save_checkpoint(path)
    layers = normswap_record(path)["layers"]
    qk = {name: rec for name, rec in layers.items() if rec.get("qk")}
    assert sorted(qk) == [f"net.blocks.{b}.attn.{n}" for b in (0, 1) for n in ("k_norm", "q_norm")]
    assert all(rec["kind"] == "mrs" and rec["eps"] == 1e-6 for rec in qk.values())
    body = {name for name, rec in layers.items() if not rec.get("qk")}
    assert body == (set() if target is None else {name for name, m in trained.named_modules()
                                                  if isinstance(m, MRSNorm) and not name.endswith(("q_norm", "k_norm"))})

    assert_same_model(NormSwap.restore(TinyModule(vit), path), path, trained, X)

    resumed, model = _fit([NormSwap(target, qk_norm="mrs")], steps=3, ckpt_path=str(path))
    assert resumed.global_step == 3 and isinstance(model.net.blocks[1].attn.k_norm, MRSNorm)


@pytest.mark.parametrize("qk_norm,here", [
    ("rms", "this run QK-norm rms(channels-last, eps=1e-06) [weight (8,)] (RMSNorm)"),
    (False, "this run not swapped [no weights] (Identity)"),
])
def test_resuming_with_other_qk_norms_is_refused_naming_the_layers(tmp_path, qk_norm, here):
    trainer, _ = _fit([NormSwap(None, qk_norm="mrs")])
    path = tmp_path / "qk.ckpt"
    trainer.save_checkpoint(path)
    line = f"net.blocks.0.attn.k_norm: checkpoint QK-norm {QK} [weight (4,)], {here}"
    with pytest.raises(MisconfigurationException, match=re.escape(line)):
        _fit([NormSwap(None, qk_norm=qk_norm)], steps=3, ckpt_path=str(path))
