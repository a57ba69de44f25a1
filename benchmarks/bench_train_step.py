"""Time one ResNet-18 (CIFAR stem) training step on the CPU, by norm layer.

Variants: ``batch`` (torchvision's BatchNorm2d), ``group`` (``GroupNorm(1, C)``, the usual
"LayerNorm" of a ResNet) and ``mrs`` (every BatchNorm2d replaced by the default
``MRSNorm2d(C, spatial=True)``, through ``lightning_mrs.swap_norms(model, target="mrs")``).
The steps are interleaved in one process, in a random order each round (``interleave.py``;
median of the rounds), so the ratios are fair even on a busy machine.

Usage::

    python benchmarks/bench_train_step.py                  # batch 64, 7 rounds
    python benchmarks/bench_train_step.py --batch 128 --rounds 9 --json step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import ratio_interval, time_steps  # noqa: E402 - the sibling helper

from lightning_mrs import swap_norms  # noqa: E402


def resnet18_cifar(num_classes: int = 100) -> nn.Module:
    """torchvision ResNet-18 with the CIFAR stem: 3x3 stride-1 conv, no max-pool."""
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _replace_bn(model: nn.Module, factory: Callable[[int], nn.Module]) -> nn.Module:
    for name, child in model.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(model, name, factory(child.num_features))
        else:
            _replace_bn(child, factory)
    return model


def to_mrs(model: nn.Module) -> tuple[nn.Module, str]:
    """Every BatchNorm2d -> MRSNorm2d(spatial=True) in place; returns the model and how."""
    report = swap_norms(model, target="mrs")
    left = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if left or not report.converted:
        raise RuntimeError(f"MRS variant still has BatchNorm layers: {left[:3]}...\n{report}")
    return model, f"{len(report.converted)} x MRSNorm2d(spatial=True) (swap_norms target='mrs')"


def build(variant: str) -> tuple[nn.Module, str]:
    torch.manual_seed(0)
    model = resnet18_cifar()
    if variant == "batch":
        return model, "torchvision BatchNorm2d"
    if variant == "group":
        return _replace_bn(model, lambda c: nn.GroupNorm(1, c)), "nn.GroupNorm(1, C)"
    if variant == "mrs":
        return to_mrs(model)
    raise ValueError(f"unknown variant {variant!r}; choose batch, group or mrs")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median)")
    p.add_argument("--steps", type=int, default=1, help="steps per model per round")
    p.add_argument("--variants", nargs="*", default=["batch", "group", "mrs"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 100, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()
    models, opts, how = {}, {}, {}
    for v in args.variants:
        models[v], how[v] = build(v)
        models[v].train()
        opts[v] = torch.optim.SGD(models[v].parameters(), lr=0.01, momentum=0.9)

    def step(v: str) -> None:
        opts[v].zero_grad(set_to_none=True)
        loss_fn(models[v](x), y).backward()
        opts[v].step()

    times = time_steps(step, list(models), args.rounds, args.steps)  # a random order each round
    med = {v: statistics.median(t) for v, t in times.items()}
    base = "batch" if "batch" in med else next(iter(med))
    print(f"ResNet-18 (CIFAR stem) train step, batch {args.batch}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; median of {args.rounds} interleaved rounds")
    best = {v: min(t) for v, t in times.items()}  # robust to other loads on a busy machine
    paired = {v: ratio_interval(times[v], times[base]) for v in models}  # per-round ratios
    print(f"{'norm':8s} {'median ms':>10s} {'x ' + base:>9s} {'min ms':>9s} {'min x':>7s} "
          f"{'paired x [95%]':>22s}  layers")
    for v in models:
        r, lo, hi = paired[v]
        print(f"{v:8s} {med[v] * 1e3:10.1f} {med[v] / med[base]:9.3f} {best[v] * 1e3:9.1f} "
              f"{best[v] / best[base]:7.3f} {r:7.3f} [{lo:.3f}, {hi:.3f}]  {how[v]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "threads": torch.get_num_threads(), "median_s": med,
                       "all_s": times, "layers": how, "paired_ratio_interval": paired}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
