"""Train-step time of a ResNet-18 (CIFAR stem) with and without ``GradientHomogeneityMonitor``.

Three configurations, measured in interleaved repeats (each repeat runs them in a rotated
order, so machine noise hits all alike), each a real Lightning ``Trainer.fit`` on the CPU with
32x32 inputs and a TensorBoard logger:

* ``none``: no monitor (the ratio's denominator);
* ``default``: the monitor at the Trainer's ``log_every_n_steps`` (50): one capture per 50 steps;
* ``every``: the monitor capturing every step (the cost of one logging step).

A step's time is measured from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
backward, optimizer step and every callback hook). The first ``--warmup`` steps of each fit
are dropped; the ``--steps`` that follow contain exactly ``steps // 50`` logging steps of the
``default`` configuration, so its mean is the amortised cost. Target: ``default`` <= 1.02.

Usage::

    python benchmarks/bench_monitor_overhead.py                      # batch 32, 50 steps, 3 repeats
    python benchmarks/bench_monitor_overhead.py --norm mrs           # after NormSwap
    python benchmarks/bench_monitor_overhead.py --batch-size 128 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torchvision
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import GradientHomogeneityMonitor
from lightning_mrs import swap_norms

INTERVAL = 50
CONFIGS = ("none", "default", "every")


class StepTimer(pl.Callback):
    """Wall time of each training step, hooks included (registered first, so outermost)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self.times.append(time.perf_counter() - self._t0)


class Classifier(pl.LightningModule):
    def __init__(self, norm: str) -> None:
        super().__init__()
        net = torchvision.models.resnet18(num_classes=100)
        net.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)  # CIFAR stem: 3x3, stride 1
        net.maxpool = nn.Identity()  # and no max-pool
        if norm == "mrs":
            swap_norms(net, "mrs")
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class LastTimer(pl.Callback):
    """Ends the hooks of a step after every other callback: the timer's end mark."""

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.timer.stop()


def fit_once(config: str, module: Classifier, loader: DataLoader, steps: int, warmup: int, logdir: str) -> list[float]:
    timer = StepTimer()
    monitor: Optional[GradientHomogeneityMonitor] = None
    if config == "default":
        monitor = GradientHomogeneityMonitor()
    elif config == "every":
        monitor = GradientHomogeneityMonitor(log_every_n_steps=1)
    # start mark first, end mark last: the monitor's own hooks fall inside the measured span
    callbacks: list[pl.Callback] = [timer, *([monitor] if monitor else []), LastTimer(timer)]
    trainer = pl.Trainer(
        max_steps=warmup + steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(logdir, name=config),
        log_every_n_steps=INTERVAL, callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return timer.times[warmup:]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=INTERVAL, help="timed steps per fit (multiple of 50)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each fit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--norm", choices=("batch", "mrs"), default="batch", help="ResNet-18's norm layers")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the raw step times here")
    args = parser.parse_args(argv)
    if args.steps % INTERVAL:
        parser.error(f"--steps must be a multiple of {INTERVAL} so the default interval's mean is its amortised cost")
    if args.threads:
        torch.set_num_threads(args.threads)
    pl.seed_everything(0, verbose=False)
    module = Classifier(args.norm)
    n = args.batch_size * (args.warmup + args.steps)
    data = TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 100, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size)
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    per_repeat: dict[str, list[float]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as logdir:
        for r in range(args.repeats):
            order = CONFIGS[r % 3 :] + CONFIGS[: r % 3]
            for config in order:
                t = fit_once(config, module, loader, args.steps, args.warmup, logdir)
                times[config] += t
                per_repeat[config].append(statistics.fmean(t))
                print(f"repeat {r + 1}/{args.repeats} {config:>7}: {1e3 * statistics.fmean(t):8.1f} ms/step",
                      file=sys.stderr, flush=True)
    base_mean = statistics.fmean(times["none"])
    base_median = statistics.median(times["none"])
    print(f"\nResNet-18 (CIFAR stem, {args.norm} norm), CPU x{torch.get_num_threads()} threads, batch "
          f"{args.batch_size}, 32x32, {args.repeats} interleaved repeats x {args.steps} steps")
    print(f"{'config':>8} | {'mean ms':>8} | {'median ms':>9} | {'mean ratio':>10} | {'median ratio':>12} | per-repeat mean ratios")
    print("-" * 96)
    for config in CONFIGS:
        mean, median = statistics.fmean(times[config]), statistics.median(times[config])
        ratios = " ".join(f"{m / b:.3f}" for m, b in zip(per_repeat[config], per_repeat["none"]))
        print(f"{config:>8} | {1e3 * mean:8.1f} | {1e3 * median:9.1f} | {mean / base_mean:10.3f} | "
              f"{median / base_median:12.3f} | {ratios}")
    # the default interval's cost, also estimated from the every-step figures (less noisy)
    log_step = statistics.median(times["every"]) / base_median
    print(f"\none logging step costs {log_step:.2f}x a plain step; amortised over {INTERVAL} steps: "
          f"{1 + (log_step - 1) / INTERVAL:.4f}x (target <= 1.02)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "times": times}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
