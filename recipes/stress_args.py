"""The stress sweep's command line: the sweep, the grid, the per-dataset defaults, ``--quick``, the help.

Every option's help states its default once; a default that depends on ``--sweep``,
``--dataset`` or ``--quick`` is written per sweep and dataset from
:data:`recipes.stress_sweeps.SWEEPS`, the same tables the parser fills the options from, so
the help cannot drift from the code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, NoReturn, Optional

from recipes.stress_sweeps import NORM, SWEEPS, Sweep

__all__ = ["DATASET_DEFAULTS", "GRID", "parse_args", "usable_cpus"]

#: the ``norm`` sweep's default grid, ``--quick`` and per-dataset defaults (the other sweep's:
#: :data:`recipes.stress_sweeps.QK`)
GRID: dict[str, list[Any]] = {"norms": NORM.grid["arms"], **{k: v for k, v in NORM.grid.items() if k != "arms"}}
DATASET_DEFAULTS: dict[str, dict[str, Any]] = NORM.datasets
_AXES = ("lrs", "batch_sizes", "seeds")
_PER_DATASET = ("arch", "arch_kwargs", "cifar_stem", "image_size", "augment", "accelerator")


def usable_cpus() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _per_dataset(key: str, show: Callable[[Any], str] = repr) -> str:
    def one(sweep: Sweep) -> str:
        parts = []
        for name, d in sweep.datasets.items():
            value = d[key]
            parts.append(f"{name} {'required' if value is None and key == 'epochs' else show(value)}")
        return "; ".join(parts)

    return f"(default: per sweep and dataset: norm: {one(NORM)} | qk: {one(SWEEPS['qk'])})"


def _per_sweep(show: Callable[[Sweep], str]) -> str:
    return "(default: " + "; ".join(f"--sweep {s.name}: {show(s)}" for s in SWEEPS.values()) + ")"


def _axis(key: str) -> Callable[[Sweep], str]:
    return lambda s: _list(s.grid[key]) + (f" (--quick: {_list(s.quick[key])})" if key in s.quick else "")


def _flag(value: bool) -> str:
    return "on" if value else "off"


def _list(values: list[Any]) -> str:
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


class _OneLineParser(argparse.ArgumentParser):
    """A command-line mistake is one ``error: ...`` line on stderr and exit status 2, not the usage."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        from recipes.errors import report

        sys.exit(report(ValueError(f"{message} (options: --help)")))


def _parser() -> argparse.ArgumentParser:
    qk = SWEEPS["qk"]
    p = _OneLineParser(
        description="A stress sweep (arms x learning rates x batch sizes x seeds) through recipes/cifar100.py's "
                    "classifier: --sweep norm, the paper's (body norms of a ResNet, SGD), or --sweep qk (QK-norms of "
                    "a small ViT, AdamW, after Wortsman et al. 2023); results.csv, robustness.csv, results.md (with "
                    "computed verdicts on the claims) and results.png in --out.",
    )
    g = p.add_argument_group("grid")
    g.add_argument("--sweep", choices=list(SWEEPS), default=NORM.name,
                   help="norm: the paper's sweep of a ResNet's body norms; qk: the QK-norms of a ViT whose "
                        "LayerNorms stay (default: norm)")
    g.add_argument("--norms", nargs="+", choices=list(NORM.arms),
                   help=f"--sweep norm: norms to compare; batch keeps the model's BatchNorm "
                        f"(default: {_list(NORM.grid['arms'])})")
    g.add_argument("--qk-norms", nargs="+", choices=list(qk.arms),
                   help=f"--sweep qk: QK-norms to compare; none adds none (default: {_list(qk.grid['arms'])})")
    g.add_argument("--lrs", nargs="+", type=float, help="peak learning rates " + _per_sweep(_axis("lrs")))
    g.add_argument("--batch-sizes", nargs="+", type=int, help=_per_sweep(_axis("batch_sizes")))
    g.add_argument("--seeds", nargs="+", type=int, help=_per_sweep(_axis("seeds")))
    g.add_argument("--quick", action="store_true",
                   help="a coarse look in a few minutes: the smaller grid and budget marked --quick, into its own "
                        "--out (default: off)")
    b = p.add_argument_group("training")
    budget = b.add_mutually_exclusive_group()
    quick_epochs = "; ".join(f"{s.name} {s.quick['epochs']['digits']}" for s in SWEEPS.values())
    budget.add_argument("--epochs", type=int, help="training epochs per cell " + _per_dataset("epochs", str)[:-1]
                        + f"; --quick on digits: {quick_epochs})")
    budget.add_argument("--max-steps", type=int, help="optimizer steps per cell, instead of --epochs (default: unset)")
    b.add_argument("--warmup-frac", type=float,
                   help="linear warm-up share of the steps; 0: the stress hits the peak lr at once "
                        + _per_sweep(lambda s: f"{s.warmup_frac:g}"))
    b.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="lr schedule after the warm-up, stepped per optimizer step (default: cosine)")
    b.add_argument("--weight-decay", type=float,
                   help="weight decay " + _per_sweep(lambda s: f"{s.weight_decay:g} ({s.optimizer})"))
    b.add_argument("--log-every", type=int, default=10,
                   help="log and capture the monitors' statistics every N steps (default: 10)")
    b.add_argument("--val-every", type=int, help="validate every N steps, always also at the end (default: every epoch)")
    b.add_argument("--limit-val-batches", type=float, default=1.0,
                   help="fraction (<= 1) or number (> 1) of validation batches (default: 1.0, all)")
    d = p.add_argument_group("data and model")
    d.add_argument("--dataset", choices=list(DATASET_DEFAULTS), default="cifar100",
                   help="digits: scikit-learn's bundled 8x8 handwritten digits (offline); synthetic: the offline "
                        "CIFAR-100-shaped stand-in (default: cifar100)")
    d.add_argument("--root", default="data", help="CIFAR-100 directory, downloaded there when missing (default: data)")
    d.add_argument("--image-size", type=int, help="images resized to this height and width " + _per_dataset("image_size"))
    d.add_argument("--augment", action=argparse.BooleanOptionalAction,
                   help="training augmentation of the data module " + _per_dataset("augment", _flag))
    d.add_argument("--arch", help="torchvision/timm model " + _per_dataset("arch"))
    d.add_argument("--arch-kwargs", type=json.loads,
                   help="JSON dict of model-builder arguments " + _per_dataset("arch_kwargs", json.dumps))
    d.add_argument("--cifar-stem", action=argparse.BooleanOptionalAction,
                   help="3x3 stride-1 stem without max-pool for ResNets " + _per_dataset("cifar_stem", _flag))
    d.add_argument("--synthetic-train-size", type=int, help="training images of synthetic (default: 50000)")
    d.add_argument("--synthetic-val-size", type=int, help="validation images of synthetic (default: 10000)")
    r = p.add_argument_group("running")
    r.add_argument("--accelerator", help="Lightning accelerator " + _per_dataset("accelerator", str))
    r.add_argument("--precision",
                   help="(default: 32-true on the CPU; bf16-mixed on GPUs with bf16, else 16-mixed)")
    r.add_argument("--mrs-backend", default="auto", help="MRSNorm implementation; same maths (default: auto)")
    r.add_argument("--jobs", type=int,
                   help="cells trained at once, each in its own process with cpus/jobs threads (default: the "
                        "usable CPU cores on the cpu accelerator, else 1)")
    r.add_argument("--num-workers", type=int, help="DataLoader workers per cell (default: 0 on the CPU, else up to 8)")
    r.add_argument("--shard", default="0/1",
                   help="K/N: run only the cells with index %% N == K, e.g. one shard per GPU into one --out "
                        "(default: 0/1, all)")
    r.add_argument("--progress", action="store_true", help="also show Lightning's per-step progress bar (default: off)")
    r.add_argument("--out", help="output directory; a rerun resumes it (default: runs/stress_<dataset>, "
                                 "runs/stress_qk_<dataset> with --sweep qk; _quick appended with --quick)")
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse ``argv``, fill the sweep's, the dataset's and ``--quick``'s defaults; user mistakes exit 2.

    ``args.sweep`` becomes the :class:`~recipes.stress_sweeps.Sweep`, ``args.arms`` the values
    of its arm (``args.norms`` or ``args.qk_norms``, filled too).
    """
    p = _parser()
    args = p.parse_args(argv)
    sweep = SWEEPS[args.sweep]
    for other in SWEEPS.values():
        if other is not sweep and getattr(args, other.flag[2:].replace("-", "_")) is not None:
            p.error(f"{other.flag} is an option of --sweep {other.name}; --sweep {sweep.name} varies {sweep.flag}")
    arms_key = sweep.flag[2:].replace("-", "_")
    if getattr(args, arms_key) is None:
        setattr(args, arms_key, list(sweep.grid["arms"]))
    args.arms = getattr(args, arms_key)
    for key in _AXES:
        if getattr(args, key) is None:
            setattr(args, key, list(sweep.quick[key]) if args.quick and key in sweep.quick else list(sweep.grid[key]))
    defaults = sweep.datasets[args.dataset]
    for key in _PER_DATASET:
        if getattr(args, key) is None:
            value = defaults[key]
            setattr(args, key, dict(value) if isinstance(value, dict) else value)
    for key in ("weight_decay", "warmup_frac"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(sweep, key))
    if args.epochs is None and args.max_steps is None:
        args.epochs = sweep.quick["epochs"].get(args.dataset) if args.quick else None
        args.epochs = args.epochs or defaults["epochs"]
        if args.epochs is None:
            p.error(f"--epochs or --max-steps is required for --dataset {args.dataset}")
    if args.out is None:
        stem = "stress" if sweep is NORM else f"stress_{sweep.name}"
        args.out = os.path.join("runs", f"{stem}_{args.dataset}" + ("_quick" if args.quick else ""))
    for name in ("epochs", "max_steps", "log_every", "val_every", "image_size", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    size = (args.arch_kwargs or {}).get("img_size") if isinstance(args.arch_kwargs, dict) else None
    if size is not None and size != args.image_size:  # a ViT takes one input size only
        p.error(f"--image-size {args.image_size} does not fit the model's img_size {size} (--arch-kwargs): "
                "give both the same size")
    if not 0.0 <= args.warmup_frac < 1.0:
        p.error(f"--warmup-frac must lie in [0, 1), got {args.warmup_frac}")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if any(lr <= 0 for lr in args.lrs):
        p.error(f"--lrs must all be > 0, got {_list(args.lrs)}")
    try:
        k, n = (int(v) for v in args.shard.split("/"))
        assert n >= 1 and 0 <= k < n
    except (ValueError, AssertionError):
        p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    args.shard_k, args.shard_n = k, n
    if args.jobs is None:
        args.jobs = usable_cpus() if args.accelerator == "cpu" else 1
    args.sweep = sweep
    return args
