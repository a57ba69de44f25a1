"""Train-step time of a small ViT with and without ``OutlierMonitor``.

The same protocol and model as ``bench_attention_monitor.py`` (whose ViT it uses):
configurations measured in interleaved repeats (each repeat runs them in a rotated
order, so machine noise hits all alike), each a real Lightning ``Trainer.fit`` with a
TensorBoard logger on one fixed random data set:

* ``none``: no monitor (the ratios' denominator);
* ``default``: the monitor at the Trainer's ``log_every_n_steps`` (50): one capture per 50
  steps, so a fit's mean step time over a multiple of 50 steps is its amortised cost;
* ``every``: the monitor capturing every step (the cost of one logging step).

A step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward,
optimizer step and every callback hook; on a GPU both marks synchronise the device), in wall
time and, on the CPU, in this process's CPU time (all threads; far less sensitive to other
processes on a shared machine); the first ``--warmup`` steps of each fit are dropped. Per
configuration the printed figure is the median over repeats of each fit's mean step time;
its ratio to ``none``'s is the overhead.
Target: ``default`` <= 1.02x ``none``.

The model: timm ``vit_small_patch16_224`` (12 blocks, width 384: 25 LayerNorms watched) on
``--img-size`` images with ``--patch-size`` patches (default 32/4: 65 tokens).

Usage (from the repository root, on an otherwise idle machine)::

    python benchmarks/bench_outlier_monitor.py                        # CPU or GPU (auto), batch 64
    python benchmarks/bench_outlier_monitor.py --accelerator gpu --batch-size 256 --repeats 5
    python benchmarks/bench_outlier_monitor.py --steps 2 --warmup 1 --repeats 1   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention_monitor import ViTClassifier, add_bench_args, report, vit_and_data  # noqa: E402 - the sibling ViT

from lightning_mrs.callbacks import OutlierMonitor  # noqa: E402

INTERVAL = 50
CONFIGS = ("none", "default", "every")
CLOCKS = ("wall", "cpu")


class StepClock(pl.Callback):
    """Wall and process-CPU time of each step: the start mark registered first, the end mark
    (``end=True``, sharing the start's lists) last, so every other hook falls inside."""

    def __init__(self, start: Optional["StepClock"] = None) -> None:
        self.start = start
        self.times: dict[str, list[float]] = {clock: [] for clock in CLOCKS}
        self._t0 = (0.0, 0.0)

    @staticmethod
    def _now(pl_module: Any) -> tuple[float, float]:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter(), time.process_time()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.start is None:
            self._t0 = self._now(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.start is not None:
            for clock, now, then in zip(CLOCKS, self._now(pl_module), self.start._t0):
                self.start.times[clock].append(now - then)


def fit_once(config: str, module: ViTClassifier, loader: DataLoader, args: argparse.Namespace, logdir: str,
             ) -> dict[str, list[float]]:
    """The timed steps of one fit of ``config``, per clock."""
    start = StepClock()
    monitor = {"none": [], "default": [OutlierMonitor()], "every": [OutlierMonitor(1)]}[config]
    trainer = pl.Trainer(
        max_steps=args.warmup + args.steps, accelerator=args.accelerator, devices=1, precision=args.precision,
        logger=TensorBoardLogger(logdir, name=config), log_every_n_steps=INTERVAL,
        callbacks=[start, *monitor, StepClock(start=start)],  # the monitor's hooks fall inside the span
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return {clock: times[args.warmup:] for clock, times in start.times.items()}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--json", default=None, help="also write each fit's mean step time here")
    args = parser.parse_args(argv)
    module, loader = vit_and_data(parser, args, "none")
    fit_means = {clock: {c: [] for c in CONFIGS} for clock in CLOCKS}  # clock -> config -> one per fit
    with tempfile.TemporaryDirectory() as logdir:
        for r in range(args.repeats):
            for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[: r % len(CONFIGS)]:
                for clock, times in fit_once(config, module, loader, args, logdir).items():
                    fit_means[clock][config].append(statistics.fmean(times))
                print(f"repeat {r + 1}/{args.repeats} {config:>7}: {1e3 * fit_means['wall'][config][-1]:8.2f} ms/step "
                      f"wall, {1e3 * fit_means['cpu'][config][-1]:8.2f} CPU", file=sys.stderr, flush=True)
    device = "cuda" if torch.cuda.is_available() and args.accelerator in ("auto", "gpu", "cuda") else "cpu"
    tokens = (args.img_size // args.patch_size) ** 2 + 1
    setting = (f"ViT-S, {tokens} tokens, batch {args.batch_size}, {args.precision}, {args.accelerator} "
               f"({device}{'' if device == 'cuda' else f' x{torch.get_num_threads()} threads'}); "
               f"{args.repeats} interleaved repeats of {args.steps} timed steps")
    for clock in CLOCKS if device == "cpu" else ("wall",):  # the host's CPU time says nothing of a GPU's work
        report(fit_means[clock], f"{setting}; {clock} time")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "fit_means": fit_means}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
