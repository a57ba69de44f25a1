"""The stress sweep's command line: the grid, the per-dataset defaults, ``--quick``, and the help text.

Every option's help states its default once; a default that depends on ``--dataset`` (or on
``--quick``) is written per dataset from :data:`DATASET_DEFAULTS` / :data:`QUICK`, the same
tables the parser fills the options from, so the help cannot drift from the code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn, Optional

__all__ = ["DATASET_DEFAULTS", "GRID", "QUICK", "parse_args", "usable_cpus"]

#: the default grid: the paper's lrs (0.1, 0.3, 0.4) inside a log-spaced axis from 0.03 to 3
GRID: dict[str, list[Any]] = {
    "norms": ["layer", "rms", "mrs", "batch"],
    "lrs": [0.03, 0.1, 0.3, 0.4, 1.0, 3.0],
    "batch_sizes": [32, 64, 128],
    "seeds": [0, 1, 2],
}
#: ``--quick``: a coarse look (one seed, three lrs, two batch sizes, shorter training on digits)
QUICK: dict[str, Any] = {"lrs": [0.1, 0.4, 3.0], "batch_sizes": [32, 128], "seeds": [0], "epochs": {"digits": 5}}

_NARROW_RESNET = {"layers": [1, 1, 1, 1], "channels": [8, 16, 32, 64], "stem_width": 8}
_SYNTHETIC_RESNET = {"layers": [1, 1, 1, 1], "channels": [32, 48, 64, 96], "stem_width": 32}
#: per dataset: model, input and budget defaults (``epochs`` None: --epochs/--max-steps required)
DATASET_DEFAULTS: dict[str, dict[str, Any]] = {
    # the 8x8 scans at their own size; a 4-block ResNet of 8-64 channels; no augmentation: 10
    # epochs bring every norm above 93 % at lr 0.1 and batch 128, and a cell costs seconds
    "digits": {"arch": "timm:resnet18", "arch_kwargs": _NARROW_RESNET, "cifar_stem": True, "image_size": 8,
               "augment": False, "epochs": 10, "accelerator": "cpu"},
    "cifar100": {"arch": "resnet18", "arch_kwargs": None, "cifar_stem": True, "image_size": 32, "augment": True,
                 "epochs": None, "accelerator": "auto"},
    "synthetic": {"arch": "timm:resnet18", "arch_kwargs": _SYNTHETIC_RESNET, "cifar_stem": False, "image_size": 32,
                  "augment": True, "epochs": None, "accelerator": "auto"},
}


def usable_cpus() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _per_dataset(key: str, show: Any = repr) -> str:
    parts = []
    for name, d in DATASET_DEFAULTS.items():
        value = d[key]
        parts.append(f"{name} {'required' if value is None and key == 'epochs' else show(value)}")
    return "(default: per dataset: " + "; ".join(parts) + ")"


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
    p = _OneLineParser(
        description="The paper's stress sweep (norms x learning rates x batch sizes x seeds) through "
                    "recipes/cifar100.py's classifier; results.csv, robustness.csv, results.md (with computed "
                    "verdicts on the paper's claims) and results.png in --out.",
    )
    g = p.add_argument_group("grid")
    g.add_argument("--norms", nargs="+", choices=["mrs", "rms", "layer", "batch"],
                   help=f"norms to compare; batch keeps the model's BatchNorm (default: {_list(GRID['norms'])})")
    g.add_argument("--lrs", nargs="+", type=float,
                   help=f"peak learning rates (default: {_list(GRID['lrs'])}; --quick: {_list(QUICK['lrs'])})")
    g.add_argument("--batch-sizes", nargs="+", type=int,
                   help=f"(default: {_list(GRID['batch_sizes'])}; --quick: {_list(QUICK['batch_sizes'])})")
    g.add_argument("--seeds", nargs="+", type=int,
                   help=f"(default: {_list(GRID['seeds'])}; --quick: {_list(QUICK['seeds'])})")
    g.add_argument("--quick", action="store_true",
                   help="a coarse look in a few minutes: the smaller grid and budget marked --quick, into its own "
                        "--out (default: off)")
    b = p.add_argument_group("training")
    budget = b.add_mutually_exclusive_group()
    budget.add_argument("--epochs", type=int, help="training epochs per cell " + _per_dataset("epochs", str)[:-1]
                        + f"; --quick on digits: {QUICK['epochs']['digits']})")
    budget.add_argument("--max-steps", type=int, help="optimizer steps per cell, instead of --epochs (default: unset)")
    b.add_argument("--warmup-frac", type=float, default=0.0,
                   help="linear warm-up share of the steps; 0: the stress hits the peak lr at once (default: 0)")
    b.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="lr schedule after the warm-up, stepped per optimizer step (default: cosine)")
    b.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay (default: 0.0005)")
    b.add_argument("--log-every", type=int, default=10,
                   help="log and capture the phasor gradient statistics every N steps (default: 10)")
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
                                 "runs/stress_<dataset>_quick with --quick)")
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse ``argv``, fill the dataset's and ``--quick``'s defaults; user mistakes exit 2."""
    p = _parser()
    args = p.parse_args(argv)
    for key, value in GRID.items():
        if getattr(args, key) is None:
            setattr(args, key, list(QUICK[key]) if args.quick and key in QUICK else list(value))
    defaults = DATASET_DEFAULTS[args.dataset]
    for key in ("arch", "arch_kwargs", "cifar_stem", "image_size", "augment", "accelerator"):
        if getattr(args, key) is None:
            value = defaults[key]
            setattr(args, key, dict(value) if isinstance(value, dict) else value)
    if args.epochs is None and args.max_steps is None:
        args.epochs = QUICK["epochs"].get(args.dataset) if args.quick else None
        args.epochs = args.epochs or defaults["epochs"]
        if args.epochs is None:
            p.error(f"--epochs or --max-steps is required for --dataset {args.dataset}")
    if args.out is None:
        args.out = os.path.join("runs", f"stress_{args.dataset}" + ("_quick" if args.quick else ""))
    for name in ("epochs", "max_steps", "log_every", "val_every", "image_size", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    try:
        k, n = (int(v) for v in args.shard.split("/"))
        assert n >= 1 and 0 <= k < n
    except (ValueError, AssertionError):
        p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    args.shard_k, args.shard_n = k, n
    if args.jobs is None:
        args.jobs = usable_cpus() if args.accelerator == "cpu" else 1
    return args
