"""The stress sweeps: arms x learning rates x batch sizes x seeds, with computed verdicts.

Two sweeps share this runner (:mod:`recipes.stress_sweeps`): ``--sweep norm`` (the default, the
paper's) varies the body norm of a ResNet; ``--sweep qk`` (after Wortsman et al. 2023, arXiv
2309.14322) varies the QK-norm of a small ViT whose LayerNorms stay. Run from the repository root:

    # offline, on a CPU: scikit-learn's handwritten digits, the defaults for that data
    # (norms layer rms mrs batch; lrs 0.03 0.1 0.3 0.4 1 3; batch sizes 32 64 128; seeds 0 1 2;
    # 10 epochs of a narrow 4-block timm resnet18 on the 8x8 scans; no warm-up; one cell per core)
    python recipes/stress.py --dataset digits
    # a coarse look in a few minutes (one seed, lrs 0.1 0.4 3, batch 32 and 128, 5 epochs)
    python recipes/stress.py --dataset digits --quick
    # the paper's grid on CIFAR-100 (a GPU; ResNet-18 with the CIFAR stem)
    python recipes/stress.py --dataset cifar100 --lrs 0.1 0.3 0.4 --epochs 30
    # the transformer sweep, offline on a CPU (QK-norms none layer rms mrs; lrs 0.001 0.003 0.01
    # 0.03 0.1 0.3; batch size 64; seeds 0 1 2; 20 epochs of a 4-block ViT on 2x2 patches of
    # the 8x8 scans; AdamW; 5 % warm-up); --quick: one seed, lrs 0.003 0.03 0.3, 10 epochs
    python recipes/stress.py --sweep qk --dataset digits
    # on CIFAR-100 (a GPU; ViT-Lite-7/4)
    python recipes/stress.py --sweep qk --dataset cifar100 --epochs 50

Every cell trains ``recipes/cifar100.py``'s ``CifarClassifier`` (``norm``: SGD, momentum 0.9,
Nesterov; ``qk``: AdamW; cosine schedule stepped per step) on ``recipes/data.py``'s
``ImageDataModule`` and records the best and final validation top-1, the first optimizer step
whose training loss was non-finite (the cell then stops and counts as chance accuracy from
there on) and the mean ``phasor/all/grad_cv`` and ``phasor/all/starved_frac`` of
``GradientHomogeneityMonitor``; a ``qk`` cell also the largest ``attention/all/logit_max``, the
smallest ``attention/all/entropy_min`` and the largest ``attention/all/collapsed_frac`` of
``AttentionMonitor`` over training.
Outputs in ``--out`` (default ``runs/stress_<dataset>``, ``runs/stress_qk_<dataset>``):

- ``cells/<cell>.json``: one file per finished cell, written atomically; the sweep's record.
  A rerun with the same ``--out`` skips these cells, so an interrupted sweep loses only the
  cells in progress.
- ``results.csv`` (one row per cell), ``robustness.csv`` (LR sensitivity and the largest lr
  still reaching 90 % of the best, per arm and batch size), ``results.md`` (setup, the
  verdict on each claim computed from ``results.csv``, the robustness tables, mean ± sd over
  seeds per cell) and ``results.png`` (top-1 against lr per batch size; ``qk``: top-1 and the
  largest attention logit against lr).
- ``tb/<cell>/``: each cell's TensorBoard run (``tensorboard --logdir <out>/tb``).
- ``settings.json``: the settings of the sweep; a rerun with different settings is refused.

Several GPUs or machines: run one sweep per device on disjoint shards of the same grid into the
same ``--out``, e.g. ``CUDA_VISIBLE_DEVICES=1 python recipes/stress.py ... --shard 1/4``.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python recipes/stress.py`: run this file as the module recipes.stress
    import os as _os
    import sys as _sys

    _sys.path[0] = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))  # the repository root
    from recipes.stress import run

    _sys.exit(run())

import argparse
import itertools
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

# Keep this import list light: a rerun with nothing left to train must not pay for torch/Lightning.
from recipes import stress_report
from recipes.errors import report
from recipes.stress_args import parse_args, usable_cpus
from recipes.stress_sweeps import ATTENTION_QUERIES, NORM

__all__ = ["main", "parse_args", "run", "sweep_settings"]

SETTINGS_FILE = "settings.json"
#: the digits split: a fixed share of each class held out for validation, the same in every cell
VAL_FRACTION, SPLIT_SEED = 0.2, 0
_FIGURE_EVERY_S = 120.0  # redrawing results.png after every cell would cost minutes over a sweep
_SPLITS = {
    "digits": f"stratified per class, {100 * VAL_FRACTION:g} % held out for validation, split seed {SPLIT_SEED}",
    "cifar100": "the official 50000 training / 10000 test images (test used for validation)",
    "synthetic": "generated training and validation sets",
}


def sweep_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that defines what a cell computes, except the grid axes."""
    keep = ("dataset", "image_size", "augment", "arch", "arch_kwargs", "cifar_stem", "epochs", "max_steps",
            "warmup_frac", "schedule", "weight_decay", "accelerator", "precision", "mrs_backend", "val_every",
            "limit_val_batches", "log_every", "synthetic_train_size", "synthetic_val_size")
    settings = {k: getattr(args, k) for k in keep}
    if settings["precision"] is None:
        settings["precision"] = "32-true" if args.accelerator == "cpu" else "auto: bf16-mixed/16-mixed on GPUs"
    sweep = args.sweep
    if sweep is not NORM:  # a norm sweep's settings stay as they were, so its older --out dirs resume
        settings = {"sweep": sweep.name, **settings, "body_norms": "the model's own (kept)",
                    "attention_monitor": f"every {args.log_every} steps, {ATTENTION_QUERIES} sampled queries per layer"}
    settings.update(optimizer=sweep.optimizer_text, split=_SPLITS[args.dataset], devices=1)
    return settings


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Refuse to mix results of different settings in one ``--out``; record them on first use."""
    path = out / SETTINGS_FILE
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            changes = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
            sys.exit(report(ValueError(f"{out} holds a sweep with other settings ({changes}): use another --out, "
                                       "or the same settings to resume that sweep.")))
        return
    stress_report.write_atomic(path, json.dumps(settings, indent=2) + "\n")


def _work(args: argparse.Namespace, out: Path, cell: tuple[str, float, int, int]) -> dict[str, Any]:
    """Train one cell (in this process or a pool worker); its record with wall and CPU seconds."""
    from recipes.stress_cell import run_cell  # torch, Lightning: only where a cell trains

    arm, lr, bs, seed = cell
    start, cpu = time.monotonic(), time.process_time()
    record = run_cell(args, out, args.sweep.cell_name(*cell), arm=arm, lr=lr, batch_size=bs, seed=seed)
    record["wall_s"] = round(time.monotonic() - start, 2)
    record["cpu_s"] = round(time.process_time() - cpu, 2)  # this process's CPU time, all its threads
    return record


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _records(args: argparse.Namespace, out: Path, todo: list[tuple]) -> Iterator[dict[str, Any]]:
    """The records of ``todo`` as they finish: in this process, or ``--jobs`` worker processes."""
    jobs = min(args.jobs, len(todo))
    if jobs <= 1:
        for cell in todo:
            yield _work(args, out, cell)
        return
    threads = max(1, usable_cpus() // jobs)
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch/OpenMP state
    with ProcessPoolExecutor(jobs, mp_context=context, initializer=_init_worker, initargs=(threads,)) as pool:
        futures = [pool.submit(_work, args, out, cell) for cell in todo]
        try:
            for future in as_completed(futures):
                yield future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def _progress(total: int) -> tuple[Callable[[str], None], Callable[[], None]]:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency; degrade to plain lines if it is missing
        return (lambda line: print(line, flush=True)), (lambda: None)
    bar = tqdm(total=total, desc="cells", unit="cell", dynamic_ncols=True)

    def line(text: str) -> None:
        bar.write(text)
        bar.update(1)

    return line, bar.close


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    settings = sweep_settings(args)
    check_settings(out, settings)

    grid = list(itertools.product(args.arms, args.lrs, args.batch_sizes, args.seeds))
    mine = [c for i, c in enumerate(grid) if i % args.shard_n == args.shard_k]
    done = {r["cell"] for r in stress_report.load_records(out)}
    todo = [c for c in mine if args.sweep.cell_name(*c) not in done]
    jobs = min(args.jobs, max(1, len(todo)))
    print(f"stress sweep: {len(grid)} cells in the grid, {len(mine) - len(todo)} of this shard already done, "
          f"{len(todo)} to run ({jobs} at a time) -> {out}", flush=True)
    command = " ".join(["python", "recipes/stress.py", *(argv if argv is not None else sys.argv[1:])])
    if todo:
        from recipes.stress_cell import check_data  # torch, Lightning: only when there is work

        check_data(args)
        line, close = _progress(len(todo))
        last_figure = time.monotonic()
        try:
            for i, record in enumerate(_records(args, out, todo), 1):
                record["command"] = command
                stress_report.write_atomic(out / "cells" / f"{record['cell']}.json", json.dumps(record) + "\n")
                figure = time.monotonic() - last_figure > _FIGURE_EVERY_S
                stress_report.write_outputs(out, settings, command, figure=figure)  # current after every cell
                last_figure = time.monotonic() if figure else last_figure
                line(f"[{i}/{len(todo)}] {record['cell']}: final top-1 {100 * record['final_top1']:.2f} %, "
                     f"best {100 * record['best_top1']:.2f} %"
                     + (f", DIVERGED at step {record['divergence_step']}" if record["diverged"] else "")
                     + (f", max attention logit {record['max_logit']:.3g}" if record.get("max_logit") else "")
                     + f" ({record['wall_s']:.0f} s, {record['cpu_s']:.0f} s CPU)")
        finally:
            close()
    stress_report.write_outputs(out, settings, command)
    print(f"wrote {out / 'results.md'} (claims, robustness, per-cell table), {out / 'results.csv'}, "
          f"{out / 'robustness.csv'}, {out / 'results.png'}; TensorBoard: tensorboard --logdir {out / 'tb'}")
    return 0


def run(argv: Optional[list[str]] = None) -> int:
    """:func:`main`, with Ctrl-C reported as a resumable interruption (exit status 130)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("\ninterrupted: finished cells are kept; rerun the same command to resume.", file=sys.stderr)
        return 130
