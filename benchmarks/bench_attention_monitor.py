"""Train-step time of a small ViT with and without ``AttentionMonitor``.

Configurations, measured in interleaved repeats (each repeat runs them in a rotated order, so
machine noise hits all alike), each a real Lightning ``Trainer.fit`` with a TensorBoard
logger, on one fixed random data set:

* ``none``: no monitor (the ratios' denominator);
* ``default``: the monitor at the Trainer's ``log_every_n_steps`` (50): one capture per 50
  steps, so a fit's mean step time over a multiple of 50 steps is its amortised cost;
* ``every``: the monitor capturing every step (the cost of one logging step).

A step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward,
optimizer step and every callback hook; on a GPU both marks synchronise the device). The
first ``--warmup`` steps of each fit are dropped. Per configuration, the printed figure is
the median over repeats of each fit's mean step time; the ratio of those medians to
``none``'s is the overhead. Target: ``default`` <= 1.02x ``none``.

The model: timm ``vit_small_patch16_224`` (12 blocks, 6 heads of 64, width 384) on
``--img-size`` images with ``--patch-size`` patches (default 32/4: 65 tokens), optionally
with MRS QK-norms (``--qk-norm mrs``).

Usage (from the repository root, on an otherwise idle machine)::

    python benchmarks/bench_attention_monitor.py                        # CPU or GPU (auto), batch 64
    python benchmarks/bench_attention_monitor.py --accelerator gpu --batch-size 256 --repeats 5
    python benchmarks/bench_attention_monitor.py --qk-norm mrs --max-queries 512 --json out.json
    python benchmarks/bench_attention_monitor.py --steps 2 --warmup 1 --repeats 1   # a quick check that it runs
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
import timm
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mrs import swap_norms
from lightning_mrs.callbacks import AttentionMonitor

INTERVAL = 50
CONFIGS = ("none", "default", "every")


class Clock(pl.Callback):
    """Start mark (registered first) or end mark (registered last) of each training step."""

    def __init__(self, start: Optional["Clock"] = None) -> None:
        self.times: list[float] = []
        self.start, self.t0 = start, 0.0

    @staticmethod
    def _now(pl_module: Any) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.start is None:
            self.t0 = self._now(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.start is not None:
            self.start.times.append(self._now(pl_module) - self.start.t0)


class ViTClassifier(pl.LightningModule):
    def __init__(self, img_size: int, patch_size: int, qk_norm: str) -> None:
        super().__init__()
        self.net = timm.create_model("vit_small_patch16_224", img_size=img_size, patch_size=patch_size,
                                     num_classes=100)
        if qk_norm != "none":
            swap_norms(self.net, None, qk_norm=qk_norm)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit_once(config: str, module: ViTClassifier, loader: DataLoader, args: argparse.Namespace, logdir: str,
             ) -> list[float]:
    start = Clock()
    interval = {"default": None, "every": 1}
    monitor = [AttentionMonitor(interval[config], max_queries=args.max_queries)] if config in interval else []
    trainer = pl.Trainer(
        max_steps=args.warmup + args.steps, accelerator=args.accelerator, devices=1, precision=args.precision,
        logger=TensorBoardLogger(logdir, name=config), log_every_n_steps=INTERVAL,
        callbacks=[start, *monitor, Clock(start=start)],  # the monitor's hooks fall inside the span
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return start.times[args.warmup:]


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The options every monitor-overhead benchmark on this ViT takes."""
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=INTERVAL, help=f"timed steps per fit (a multiple of {INTERVAL})")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each fit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accelerator", default="auto", help="Trainer(accelerator=...): auto, cpu, gpu")
    parser.add_argument("--precision", default="32-true", help="Trainer(precision=...), e.g. bf16-mixed")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def vit_and_data(parser: argparse.ArgumentParser, args: argparse.Namespace, qk_norm: str
                 ) -> tuple[ViTClassifier, DataLoader]:
    """Check the common options, set the threads and the seed; the model and enough random batches."""
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--steps and --repeats must be >= 1, --warmup >= 0")
    if args.steps % INTERVAL:
        print(f"note: --steps {args.steps} is not a multiple of {INTERVAL}: 'default' is then not its amortised "
              "cost", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    pl.seed_everything(0, verbose=False)
    module = ViTClassifier(args.img_size, args.patch_size, qk_norm)
    n = args.batch_size * (args.warmup + args.steps)
    data = TensorDataset(torch.randn(n, 3, args.img_size, args.img_size), torch.randint(0, 100, (n,)))
    return module, DataLoader(data, batch_size=args.batch_size)


def report(fit_means: dict[str, list[float]], header: str) -> None:
    """The table of medians, ratios to ``none`` and per-repeat ratios, and the amortised cost."""
    print(header)
    base = statistics.median(fit_means["none"])
    print(f"{'config':>8} | {'median of fit means, ms':>23} | {'ratio to none':>13} | per-repeat ratios")
    for config, means in fit_means.items():
        ratios = " ".join(f"{m / b:.3f}" for m, b in zip(means, fit_means["none"]))
        print(f"{config:>8} | {1e3 * statistics.median(means):23.2f} | {statistics.median(means) / base:13.3f} | {ratios}")
    every = statistics.median(fit_means["every"]) / base
    print(f"one logging step costs {every:.3f}x a plain step -> amortised over {INTERVAL} steps "
          f"{1 + (every - 1) / INTERVAL:.4f}x; measured at the default interval "
          f"{statistics.median(fit_means['default']) / base:.4f}x (target <= 1.02)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--qk-norm", choices=("none", "mrs", "rms", "layer"), default="none")
    parser.add_argument("--max-queries", type=int, default=256, help="AttentionMonitor(max_queries=...)")
    parser.add_argument("--json", default=None, help="also write the raw step times here")
    args = parser.parse_args(argv)
    module, loader = vit_and_data(parser, args, args.qk_norm)
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}  # every timed step
    fit_means: dict[str, list[float]] = {c: [] for c in CONFIGS}  # one per fit
    with tempfile.TemporaryDirectory() as logdir:
        for r in range(args.repeats):
            for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[: r % len(CONFIGS)]:
                t = fit_once(config, module, loader, args, logdir)
                times[config] += t
                fit_means[config].append(statistics.fmean(t))
                print(f"repeat {r + 1}/{args.repeats} {config:>7}: {1e3 * fit_means[config][-1]:8.2f} ms/step",
                      file=sys.stderr, flush=True)
    device = "cuda" if torch.cuda.is_available() and args.accelerator in ("auto", "gpu", "cuda") else "cpu"
    tokens = (args.img_size // args.patch_size) ** 2 + 1
    report(fit_means, f"ViT-S ({args.qk_norm} QK-norm), {tokens} tokens, batch {args.batch_size}, {args.precision}, "
           f"{args.accelerator} ({device}{'' if device == 'cuda' else f' x{torch.get_num_threads()} threads'}), "
           f"max_queries={args.max_queries}; {args.repeats} interleaved repeats of {args.steps} timed steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "times": times, "fit_means": fit_means}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
