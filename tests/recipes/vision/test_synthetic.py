"""The synthetic CIFAR-100 stand-in: shapes, determinism, splits, errors, and that it is learnable."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recipes.vision.synthetic import SyntheticCIFAR100, make_prototypes


@pytest.mark.parametrize("size,num_classes,image_size", [(10, 100, 32), (37, 7, 17), (5, 2, 8)])
def test_shapes_dtype_labels(size: int, num_classes: int, image_size: int) -> None:
    ds = SyntheticCIFAR100(train=True, size=size, num_classes=num_classes, image_size=image_size)
    assert len(ds) == size
    for i in range(size):
        image, label = ds[i]
        assert image.shape == (3, image_size, image_size) and image.dtype == torch.uint8
        assert label == i % num_classes  # balanced labels
    assert len(ds.classes) == num_classes


def test_default_sizes_match_cifar100() -> None:
    assert len(SyntheticCIFAR100(train=True)) == 50_000
    assert len(SyntheticCIFAR100(train=False)) == 10_000


def test_deterministic_across_instances_and_access_order() -> None:
    a, b = SyntheticCIFAR100(train=True, size=300), SyntheticCIFAR100(train=True, size=300)
    order = [299, 0, 17, 150, 17]
    first = [a[i][0] for i in order]
    torch.manual_seed(1234)  # the global RNG must not matter
    second = [b[i][0] for i in reversed(order)][::-1]
    for x, y in zip(first, second):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert torch.equal(a[-1][0], a[299][0])


def test_splits_and_seeds_differ() -> None:
    train, val = SyntheticCIFAR100(train=True, size=100), SyntheticCIFAR100(train=False, size=100)
    other_seed = SyntheticCIFAR100(train=True, size=100, seed=1)
    assert not torch.equal(train[5][0], val[5][0])
    assert not torch.equal(train[5][0], other_seed[5][0])
    assert train[5][1] == val[5][1] == other_seed[5][1] == 5


def test_images_use_the_intensity_range_without_saturating() -> None:
    ds = SyntheticCIFAR100(train=True, size=200)
    x = torch.stack([ds[i][0] for i in range(200)]).double() / 255  # (200, 3, 32, 32)
    assert 0.4 < x.mean().item() < 0.6
    assert 0.1 < x.std().item() < 0.35
    saturated = ((x == 0) | (x == 1)).double().mean().item()
    assert saturated < 0.05  # noise clips a few pixels, as in real photos


def test_prototypes_are_normalised_and_distinct() -> None:
    p = make_prototypes(100, 32, seed=0).double()  # (100, 3, 32, 32)
    flat = p.flatten(1)
    torch.testing.assert_close(flat.mean(1), torch.zeros(100, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(flat.std(1), torch.ones(100, dtype=torch.float64), atol=1e-5, rtol=0)
    cos = F.normalize(flat, dim=1) @ F.normalize(flat, dim=1).T  # (100, 100)
    off_diagonal = cos[~torch.eye(100, dtype=torch.bool)]
    assert off_diagonal.abs().max().item() < 0.9  # no two classes share a pattern


def test_sample_correlates_with_its_own_prototype_most() -> None:
    """An independent check of the class signal: unshifted correlation with the 100 prototypes."""
    ds = SyntheticCIFAR100(train=False, size=300, max_shift=0, distractor=0.0)
    protos = F.normalize(ds.prototypes.double().flatten(1), dim=1)  # (100, 3072)
    hits = 0
    for i in range(300):
        image, label = ds[i]
        x = image.double().flatten() / 255
        hits += int((protos @ (x - x.mean())).argmax().item() == label)
    assert hits / 300 > 0.9


@pytest.mark.parametrize(
    "kwargs,match",
    [({"size": 0}, "size"), ({"num_classes": 1}, "num_classes"), ({"image_size": 4}, "image_size"),
     ({"noise": -1.0}, "noise"), ({"distractor": 1.0}, "distractor")],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyntheticCIFAR100(**kwargs)


def test_index_out_of_range() -> None:
    ds = SyntheticCIFAR100(size=4)
    with pytest.raises(IndexError, match="out of range"):
        ds[4]


def _small_cnn() -> nn.Module:
    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    # strided early: cheap on a shared CPU (~2 M multiply-adds per image)
    return nn.Sequential(
        *block(3, 32, 2), *block(32, 64, 2), *block(64, 96, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(96, 100),
    )


def _train_and_eval(steps: int, batch_size: int, lr: float) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions: one thread is faster on a shared CPU
    try:
        return _train_and_eval_impl(steps, batch_size, lr)
    finally:
        torch.set_num_threads(threads)


def _train_and_eval_impl(steps: int, batch_size: int, lr: float) -> float:
    torch.manual_seed(0)
    train = SyntheticCIFAR100(train=True, size=steps * batch_size)
    val = SyntheticCIFAR100(train=False, size=1000)
    loader = torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=True)
    model = _small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15)

    def prep(x: torch.Tensor) -> torch.Tensor:
        return (x.float() / 255 - 0.5) / 0.22  # (N, 3, 32, 32)

    model.train()
    for x, y in loader:
        loss = F.cross_entropy(model(prep(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    vx = torch.stack([val[i][0] for i in range(len(val))])
    vy = torch.tensor([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        return (model(prep(vx)).argmax(1) == vy).double().mean().item()


def test_learnable_quick() -> None:
    """A small CNN beats the 1 % chance level by a wide margin within 200 SGD steps."""
    accuracy = _train_and_eval(steps=200, batch_size=64, lr=0.2)
    assert accuracy > 0.20, f"top-1 {accuracy:.3f} after 200 steps; chance is 0.01"


@pytest.mark.slow
def test_learnable_long() -> None:
    """A few hundred steps reach far above chance (but the task is not trivial)."""
    accuracy = _train_and_eval(steps=600, batch_size=64, lr=0.2)
    assert accuracy > 0.6, f"top-1 {accuracy:.3f} after 600 steps"
    assert not math.isnan(accuracy)
