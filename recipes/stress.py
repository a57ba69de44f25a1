"""The paper's stress sweep: norms x learning rates x batch sizes x seeds, one table and figure.

Run from the repository root, e.g. the paper's grid on CIFAR-100 (one GPU, 200-epoch budget
cut to 30 here):

    python recipes/stress.py --norms layer rms mrs --lrs 0.1 0.3 0.4 --batch-sizes 32 64 128 \\
        --seeds 0 1 2 --epochs 30 --dataset cifar100 --out runs/stress
    # offline, on a CPU, a few minutes (synthetic data, timm's tiny test_resnet)
    python recipes/stress.py --dataset synthetic --norms layer rms mrs --lrs 0.1 0.4 \\
        --batch-sizes 32 --seeds 0 --max-steps 200 --out runs/stress_demo

Every cell trains ``recipes/cifar100.py``'s ``CifarClassifier`` on ``CifarDataModule`` (same
optimizer, schedule and augmentation) and records the best and final validation top-1, the
first optimizer step whose training loss was non-finite (the cell then stops: a divergence,
not a crash), and the mean ``phasor/all/grad_cv`` and ``phasor/all/starved_frac`` logged by
``GradientHomogeneityMonitor``. Outputs in ``--out``:

- ``cells/<cell>.json``: one file per finished cell, written atomically when it finishes;
  the sweep's record. A rerun with the same ``--out`` skips these cells, so an interrupted
  sweep loses only the cell in progress.
- ``results.csv`` (one row per finished cell), ``results.md`` (mean +- std over seeds per
  norm x lr x batch size, divergences marked, the exact settings) and ``results.png``
  (accuracy per cell, training curves by norm), rebuilt from ``cells/`` on every run.
- ``tb/<cell>/``: each cell's TensorBoard run (``tensorboard --logdir <out>/tb``).
- ``settings.json``: the settings of the sweep; a rerun with different settings is refused.

Several GPUs: run one sweep per GPU on disjoint shards of the same grid into the same
``--out``, e.g. ``CUDA_VISIBLE_DEVICES=1 python recipes/stress.py ... --shard 1/4``.
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
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

# Keep this import list light: a rerun with nothing left to train must not pay for torch/Lightning.
from recipes import stress_report

SETTINGS_FILE = "settings.json"
# The synthetic default: small enough for a CPU, and it learns within a few hundred steps with
# every norm (the CIFAR stem and timm's tiny test_resnet stay near chance that long on it).
SYNTHETIC_ARCH = "timm:resnet18"
SYNTHETIC_ARCH_KWARGS = {"layers": [1, 1, 1, 1], "channels": [32, 48, 64, 96], "stem_width": 32}
# settings that do not change what a cell computes, so a rerun may change them freely
_FREE_SETTINGS = ("num_workers", "shard", "progress", "out", "root")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="The paper's stress sweep (norms x lrs x batch sizes x seeds) through recipes/cifar100.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--norms", nargs="+", default=["layer", "rms", "mrs"], choices=["mrs", "rms", "layer", "batch"])
    p.add_argument("--lrs", nargs="+", type=float, default=[0.1, 0.3, 0.4], help="peak learning rates")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--epochs", type=int, help="training epochs per cell")
    budget.add_argument("--max-steps", type=int, help="optimizer steps per cell")
    p.add_argument("--dataset", choices=["cifar100", "synthetic"], default="cifar100")
    p.add_argument("--root", default="data", help="CIFAR-100 directory (downloaded there when missing)")
    p.add_argument("--arch", default=None,
                   help="torchvision/timm model; default resnet18 (CIFAR stem) for cifar100, a narrow 4-block "
                        "timm resnet18 (ImageNet stem) for synthetic")
    p.add_argument("--arch-kwargs", type=json.loads, default=None,
                   help='JSON dict of extra model-builder arguments, e.g. \'{"layers": [1, 1, 1, 1]}\'')
    p.add_argument("--cifar-stem", action=argparse.BooleanOptionalAction, default=None,
                   help="3x3 stride-1 stem without max-pool for ResNets (default: on for cifar100, off for synthetic)")
    p.add_argument("--warmup-frac", type=float, default=0.0,
                   help="linear warm-up fraction of the steps (0: the stress hits the peak lr at once)")
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--mrs-backend", default="auto", help="MRSNorm implementation (auto, eager, ...): same maths")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--precision", default=None, help="default: bf16-mixed/16-mixed on GPUs, 32-true on CPU")
    p.add_argument("--val-every", type=int, default=None,
                   help="validate every N steps (default: every epoch); always also at the end")
    p.add_argument("--limit-val-batches", type=float, default=1.0, help="fraction (<=1) or number of val batches")
    p.add_argument("--log-every", type=int, default=10, help="log and capture phasor statistics every N steps")
    p.add_argument("--synthetic-train-size", type=int, default=None)
    p.add_argument("--synthetic-val-size", type=int, default=None)
    p.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default: auto)")
    p.add_argument("--shard", default="0/1", help="K/N: run only the cells with index %% N == K")
    p.add_argument("--progress", action="store_true", help="also show Lightning's per-step progress bar")
    p.add_argument("--out", required=True, help="output directory (reused: finished cells are skipped)")
    args = p.parse_args(argv)
    if args.arch is None:
        args.arch = "resnet18" if args.dataset == "cifar100" else SYNTHETIC_ARCH
        if args.dataset == "synthetic" and args.arch_kwargs is None:
            args.arch_kwargs = dict(SYNTHETIC_ARCH_KWARGS)
    if args.cifar_stem is None:
        args.cifar_stem = args.dataset == "cifar100"
    for name in ("epochs", "max_steps", "log_every", "val_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    try:
        k, n = (int(v) for v in args.shard.split("/"))
        assert n >= 1 and 0 <= k < n
    except (ValueError, AssertionError):
        p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    args.shard_k, args.shard_n = k, n
    return args


def cell_name(norm: str, lr: float, batch_size: int, seed: int) -> str:
    """The cell's id: its TensorBoard run name and the stem of its record file."""
    return f"{norm}_lr{lr:g}_bs{batch_size}_seed{seed}"


def sweep_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Everything that defines what a cell computes, except the grid axes."""
    keep = ("dataset", "arch", "arch_kwargs", "cifar_stem", "epochs", "max_steps", "warmup_frac", "schedule", "weight_decay", "accelerator",
            "precision", "mrs_backend", "val_every", "limit_val_batches", "log_every", "synthetic_train_size", "synthetic_val_size")
    settings = {k: getattr(args, k) for k in keep}
    settings.update(optimizer="SGD momentum 0.9 nesterov", augmentation="random crop 32 pad 4 + horizontal flip",
                    devices=1)
    return settings


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Refuse to mix results of different settings in one ``--out``; record them on first use."""
    path = out / SETTINGS_FILE
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if diff:
            lines = "\n".join(f"  {k}: {a!r} in {path} vs {b!r} now" for k, (a, b) in diff.items())
            sys.exit(f"error: {out} holds a sweep with other settings:\n{lines}\n"
                     "Use another --out, or the same settings to resume that sweep.")
        return
    stress_report.write_atomic(path, json.dumps(settings, indent=2) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    settings = sweep_settings(args)
    check_settings(out, settings)

    grid = list(itertools.product(args.norms, args.lrs, args.batch_sizes, args.seeds))
    mine = [c for i, c in enumerate(grid) if i % args.shard_n == args.shard_k]
    done = {r["cell"] for r in stress_report.load_records(out)}
    todo = [c for c in mine if cell_name(*c) not in done]
    print(f"stress sweep: {len(grid)} cells in the grid, {len(mine) - len(todo)} of this shard already done, "
          f"{len(todo)} to run -> {out}", flush=True)
    command = " ".join(["python", "recipes/stress.py", *(argv if argv is not None else sys.argv[1:])])
    if todo:
        from recipes.stress_cell import check_data, run_cell  # torch, Lightning: only when there is work

        check_data(args)
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is a dependency; degrade to plain lines if it is missing
            tqdm = None
        bar = tqdm(total=len(todo), desc="cells", unit="cell", dynamic_ncols=True) if tqdm else None
        for i, (norm, lr, bs, seed) in enumerate(todo, 1):
            name = cell_name(norm, lr, bs, seed)
            if bar is not None:
                bar.set_postfix_str(name)
            start = time.monotonic()
            record = run_cell(args, out, name, norm=norm, lr=lr, batch_size=bs, seed=seed)
            record["wall_s"] = round(time.monotonic() - start, 1)
            record["command"] = command
            stress_report.write_atomic(out / "cells" / f"{name}.json", json.dumps(record) + "\n")
            stress_report.write_outputs(out, settings, command)  # the table is current after every cell
            line = (f"[{i}/{len(todo)}] {name}: final top-1 {100 * record['final_top1']:.2f} %, "
                    f"best {100 * record['best_top1']:.2f} %"
                    + (f", DIVERGED at step {record['divergence_step']}" if record["diverged"] else "")
                    + f" ({record['wall_s']:.0f} s)")
            if bar is not None:
                bar.write(line)
                bar.update(1)
            else:
                print(line, flush=True)
        if bar is not None:
            bar.close()
    stress_report.write_outputs(out, settings, command)
    print(f"wrote {out / 'results.csv'}, {out / 'results.md'}, {out / 'results.png'}; "
          f"TensorBoard: tensorboard --logdir {out / 'tb'}")
    return 0


def run(argv: Optional[list[str]] = None) -> int:
    """:func:`main`, with Ctrl-C reported as a resumable interruption (exit status 130)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("\ninterrupted: finished cells are kept; rerun the same command to resume.", file=sys.stderr)
        return 130
