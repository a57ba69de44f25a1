"""A torchvision detector with its backbone swapped (issue 45 §5): Faster R-CNN on MobileNetV3
(``fasterrcnn_mobilenet_v3_large_fpn``, no weights), one train step and one eval.

"Backbone swapped" means ``swap_norms(model.backbone, "mrs")``: every norm of the detector sits in
the MobileNetV3 body (the FPN, RPN head and box head have none), so this is also
``swap_norms(model, "mrs")``. Built without weights, torchvision gives the body trainable
``BatchNorm2d`` layers; built for a pretrained backbone (``weights_backbone=...``) it gives
``FrozenBatchNorm2d`` and freezes the first stages. The swap keeps that: a ``FrozenBatchNorm2d``
becomes an ``MRSNorm2d(spatial=True)`` whose weight does not train (``requires_grad=False``);
``requires_grad_(True)`` on it trains it, since MRSNorm has no batch statistics to protect.

MRSNorm is not the identity at init (it divides by the mean phasor magnitude), so the swapped
detector is checked against the unswapped detector with its norms replaced by the independent
float64 formula (``tests/helpers/reference.py``) at the same places with the same weights: the
backbone's FPN features and the norm weights' gradients must agree.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

pytest.importorskip("torchvision", reason="the detector is torchvision's")

from torchvision.models import mobilenet_v3_large
from torchvision.models.detection import FasterRCNN, fasterrcnn_mobilenet_v3_large_fpn
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import _mobilenet_extractor
from torchvision.ops.misc import FrozenBatchNorm2d

import lightning_mrs as lm
from helpers.reference import mrs_norm_ref

# small images and fewer proposals and sampled boxes: a step in a few seconds
SIZE = dict(min_size=64, max_size=96, rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=100,
            rpn_pre_nms_top_n_test=100, rpn_post_nms_top_n_test=50, box_batch_size_per_image=64,
            box_detections_per_img=20)


class _ReferenceMRS2d(nn.Module):
    """MRSNorm2d(spatial=True) as the float64 formula of docs/method.md, independent of the op."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mrs_norm_ref(x, self.weight, self.eps, channel_dim=1, spatial=True).to(x.dtype)


def _detector() -> FasterRCNN:
    # box_score_thresh=0: random weights score every class near 1/num_classes; keep the boxes
    return fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None, num_classes=5,
                                             box_score_thresh=0.0, **SIZE)


def _frozen_detector() -> FasterRCNN:
    """What ``fasterrcnn_mobilenet_v3_large_fpn(weights_backbone=...)`` builds, without the
    download: FrozenBatchNorm2d in the body, the first stages frozen (torchvision's default 3)."""
    body = _mobilenet_extractor(mobilenet_v3_large(norm_layer=FrozenBatchNorm2d), True, 3)
    anchors = AnchorGenerator(((32, 64, 128, 256, 512),) * 3, ((0.5, 1.0, 2.0),) * 3)
    return FasterRCNN(body, 5, rpn_anchor_generator=anchors, box_score_thresh=0.0, **SIZE)


def _batch() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    images = [torch.rand(3, 96, 120), torch.rand(3, 110, 96)]
    targets = [dict(boxes=torch.tensor([[10.0, 10.0, 50.0, 60.0]]), labels=torch.tensor([1])),
               dict(boxes=torch.tensor([[5.0, 20.0, 40.0, 90.0], [30.0, 30.0, 80.0, 70.0]]), labels=torch.tensor([3, 2]))]
    return images, targets


def _swapped_norms(model: nn.Module) -> dict[str, lm.MRSNorm2d]:
    return {n: m for n, m in model.named_modules() if isinstance(m, lm.MRSNorm2d)}


def _swap_backbone(model: FasterRCNN, source: type) -> dict[str, lm.MRSNorm2d]:
    n_norms = sum(isinstance(m, source) for m in model.modules())
    # every norm of the detector is in the body: swapping the backbone swaps them all
    assert n_norms and n_norms == sum(isinstance(m, source) for m in model.backbone.body.modules())
    report = lm.swap_norms(model.backbone, "mrs")
    norms = _swapped_norms(model)
    assert len(report.converted) == len(norms) == n_norms and not report.skipped, str(report)
    assert not any(isinstance(m, source) for m in model.modules())
    with torch.no_grad():  # weights off their init: a misplaced weight changes the features
        for m in norms.values():
            m.weight.add_(0.2 * torch.randn_like(m.weight))
    return norms


def _train_step(model: FasterRCNN) -> dict[str, torch.Tensor]:
    images, targets = _batch()
    model.train()
    losses = model(images, targets)
    total = sum(losses.values())
    assert math.isfinite(total.item()), losses
    total.backward()
    return losses


def _eval(model: FasterRCNN) -> list[dict[str, torch.Tensor]]:
    model.eval()
    with torch.no_grad():
        detections = model(_batch()[0])
    for image, det in zip(_batch()[0], detections):
        assert det["boxes"].shape[0] > 0 and det["boxes"].shape == (det["scores"].shape[0], 4)
        assert torch.isfinite(det["boxes"]).all() and torch.isfinite(det["scores"]).all()
        assert (det["boxes"][:, 2] <= image.shape[2] + 1e-3).all() and (det["boxes"][:, 3] <= image.shape[1] + 1e-3).all()
    return detections


def test_detector_backbone_swapped_trains_and_detects() -> None:
    model = _detector()
    unswapped = copy.deepcopy(model)
    norms = _swap_backbone(model, nn.BatchNorm2d)
    losses = _train_step(model)
    control = _train_step(unswapped)  # the unswapped path: the same losses come out
    assert losses.keys() == control.keys()
    for name, norm in norms.items():
        assert norm.weight.grad is not None and torch.isfinite(norm.weight.grad).all(), name
        assert norm.weight.grad.abs().sum() > 0, f"no gradient reached {name}"
    detections = _eval(model)
    assert [d.keys() for d in detections] == [d.keys() for d in _eval(unswapped)]


def test_detector_backbone_equals_reference_formula() -> None:
    """The swapped backbone's FPN features and its norm weights' gradients equal the unswapped
    detector's with each BatchNorm replaced by the float64 formula (same weights, same places)."""
    model = _detector()
    reference = copy.deepcopy(model)
    norms = _swap_backbone(model, nn.BatchNorm2d)
    for name, norm in norms.items():
        parent, _, child = name.rpartition(".")
        setattr(reference.get_submodule(parent), child, _ReferenceMRS2d(norm.weight, norm.eps))
    images = torch.rand(2, 3, 64, 96)
    features, grads = [], []
    for net in (model, reference):
        out = net.eval().backbone(images)
        sum((f * torch.linspace(-1, 1, f.numel()).view_as(f)).sum() for f in out.values()).backward()
        features.append({k: v.detach() for k, v in out.items()})
        grads.append({n: m.weight.grad for n, m in net.named_modules() if n in norms})
    swapped_features, ref_features = features
    assert swapped_features.keys() == ref_features.keys()
    for key in swapped_features:
        torch.testing.assert_close(swapped_features[key], ref_features[key], atol=1e-4, rtol=1e-4)
    for name in norms:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-4, rtol=1e-3)


@pytest.mark.slow  # two train steps of its own
def test_detector_frozen_backbone_stays_frozen() -> None:
    """FrozenBatchNorm2d (the pretrained-backbone build) becomes a frozen MRSNorm2d: the step
    trains the unfrozen convolutions and heads and leaves the MRS weights alone."""
    model = _frozen_detector()
    norms = _swap_backbone(model, FrozenBatchNorm2d)
    before = {n: m.weight.detach().clone() for n, m in norms.items()}
    _train_step(model)
    assert all(not m.weight.requires_grad and m.weight.grad is None for m in norms.values())
    trained = [n for n, p in model.backbone.body.named_parameters() if p.grad is not None]
    assert trained and all(p.grad is None for p in model.backbone.body["0"].parameters())  # stage 0: frozen
    assert all(torch.equal(m.weight, before[n]) for n, m in norms.items())
    _eval(model)
    for m in norms.values():  # unfreezing trains them
        m.weight.requires_grad_(True)
    _train_step(model)
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in norms.values())
