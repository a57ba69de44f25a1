"""Train-step time of a ResNet-18 (CIFAR stem) with and without ``GradientHomogeneityMonitor``.

Configurations, measured in interleaved repeats (each repeat runs them in a rotated order, so
machine noise hits all alike), each a real Lightning ``Trainer.fit`` on the CPU with 32x32
inputs and a TensorBoard logger:

* ``none``: no monitor (the ratios' denominator);
* ``default``: the monitor at the Trainer's ``log_every_n_steps`` (50): one capture per 50 steps;
* ``every``: the monitor capturing every step (the cost of a logging step);
* ``paired``: capturing every 2nd step; each logging step is compared with the plain step just
  before it in the same fit, which cancels slow drifts of a shared machine.

A step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward,
optimizer step and every callback hook), both in wall time and in this process's CPU time
(all threads; far less sensitive to other processes on a shared machine). The first
``--warmup`` steps of each fit are dropped; ``none`` and ``default`` then time ``--steps``
steps (a multiple of 50, so ``default``'s mean is its amortised cost), ``every`` and ``paired``
``--short-steps``. Target: ``default`` <= 1.02x ``none``.

Usage::

    python benchmarks/bench_monitor_overhead.py                       # batch 32, 3 repeats
    python benchmarks/bench_monitor_overhead.py --norm mrs            # after swap_norms(..., "mrs")
    python benchmarks/bench_monitor_overhead.py --batch-size 8 --repeats 2 --json out.json
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

from lightning_mrs.callbacks import GradientHomogeneityMonitor
from lightning_mrs import swap_norms

INTERVAL = 50
CONFIGS = ("none", "default", "every", "paired")


class StepTimer(pl.Callback):
    """Wall and process-CPU time of each training step (registered first: the outermost hook)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._t0 = (0.0, 0.0)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._t0[0])
        self.cpu.append(time.process_time() - self._t0[1])


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


def fit_once(config: str, module: Classifier, loader: DataLoader, steps: int, warmup: int, logdir: str) -> StepTimer:
    timer = StepTimer()
    interval = {"default": None, "every": 1, "paired": 2}
    monitor = GradientHomogeneityMonitor(log_every_n_steps=interval[config]) if config in interval else None
    # start mark first, end mark last: the monitor's own hooks fall inside the measured span
    callbacks: list[pl.Callback] = [timer, *([monitor] if monitor else []), LastTimer(timer)]
    trainer = pl.Trainer(
        max_steps=warmup + steps, accelerator="cpu", devices=1, logger=TensorBoardLogger(logdir, name=config),
        log_every_n_steps=INTERVAL, callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    timer.wall, timer.cpu = timer.wall[warmup:], timer.cpu[warmup:]
    return timer


def _table(title: str, times: dict[str, list[float]], per_repeat: dict[str, list[float]]) -> None:
    base_mean, base_median = statistics.fmean(times["none"]), statistics.median(times["none"])
    print(f"\n{title}")
    print(f"{'config':>8} | {'mean ms':>8} | {'median ms':>9} | {'mean ratio':>10} | {'median ratio':>12} | "
          "per-repeat mean ratios")
    print("-" * 96)
    for config in ("none", "default", "every"):
        mean, median = statistics.fmean(times[config]), statistics.median(times[config])
        ratios = " ".join(f"{m / b:.3f}" for m, b in zip(per_repeat[config], per_repeat["none"]))
        print(f"{config:>8} | {1e3 * mean:8.1f} | {1e3 * median:9.1f} | {mean / base_mean:10.3f} | "
              f"{median / base_median:12.3f} | {ratios}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=INTERVAL, help="timed steps per fit (multiple of 50)")
    parser.add_argument("--short-steps", type=int, default=20, help="timed steps per fit of every/paired")
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
    clocks = ("wall", "cpu")
    times = {k: {c: [] for c in CONFIGS} for k in clocks}
    per_repeat = {k: {c: [] for c in CONFIGS} for k in clocks}
    paired = {k: [] for k in clocks}  # logging step / the plain step before it
    with tempfile.TemporaryDirectory() as logdir:
        for r in range(args.repeats):
            order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
            for config in order:
                steps = args.steps if config in ("none", "default") else args.short_steps
                timer = fit_once(config, module, loader, steps, args.warmup, logdir)
                for k in clocks:
                    t = getattr(timer, k)
                    times[k][config] += t
                    per_repeat[k][config].append(statistics.fmean(t))
                    if config == "paired":
                        # global step g is a logging step when (g + 1) % 2 == 0; t[i] is step warmup + i
                        paired[k] += [t[i] / t[i - 1] for i in range(1, len(t)) if (args.warmup + i + 1) % 2 == 0]
                print(f"repeat {r + 1}/{args.repeats} {config:>7}: wall {1e3 * statistics.fmean(timer.wall):8.1f} "
                      f"ms/step, cpu {1e3 * statistics.fmean(timer.cpu):8.1f} ms/step", file=sys.stderr, flush=True)
    print(f"ResNet-18 (CIFAR stem, {args.norm} norm), CPU x{torch.get_num_threads()} threads, batch "
          f"{args.batch_size}, 32x32, {args.repeats} interleaved repeats; none/default {args.steps} steps, "
          f"every/paired {args.short_steps} steps per fit")
    for k, label in (("wall", "wall-clock time per step"), ("cpu", "process CPU time per step (all threads)")):
        _table(label, times[k], per_repeat[k])
    print(f"\ncost of one logging step, paired with the plain step before it ({len(paired['cpu'])} pairs):")
    for k in clocks:
        ratio = statistics.median(paired[k])
        print(f"  {k:>4}: median {ratio:.3f}x a plain step -> amortised over {INTERVAL} steps "
              f"{1 + (ratio - 1) / INTERVAL:.4f}x (target <= 1.02)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "times": times, "paired": paired}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
