"""The stress sweep's command line: the sweep kind, the grid, the per-dataset defaults, ``--quick``, the help.

Every option's help states its default once; a default that depends on ``--sweep``, ``--dataset`` or
``--quick`` is written per kind and dataset from the kinds' own tables (:mod:`recipes.sweeps.kinds`),
the ones the parser fills the options from, so the help cannot drift from the code. A mistake is one
``error: ...`` line and exit status 2, in this command's own option names.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any, Callable, Mapping, NoReturn, Optional, Sequence

from recipes.common.errors import UsageError, report
from recipes.sweeps.kind import Sweep
from recipes.sweeps.records import same_lr

__all__ = ["AXES", "PER_DATASET", "in_sweep_terms", "parse_args", "usable_cpus"]

AXES = ("lrs", "batch_sizes", "seeds")
PER_DATASET = ("arch", "arch_kwargs", "cifar_stem", "image_size", "augment", "accelerator")
DATASETS = ("digits", "cifar100", "folder", "synthetic", "stdlib", "text")
# the recipes' (recipes/cifar100.py, recipes/lm.py) option names, as the sweep calls them
_RECIPE_FLAGS = (("--model.arch_kwargs", "--arch-kwargs"), ("--model.config", "--arch-kwargs"),
                 ("--model.arch", "--arch"), ("--data.path", "--path"),
                 ("--data.image_size", "--image-size"), ("--data.batch_size", "--batch-sizes"),
                 ("--data.dataset", "--dataset"), ("--data.root", "--root"), ("--data.val_fraction", "the split"),
                 ("--model.mrs_backend", "--mrs-backend"), ("--model.warmup_frac", "--warmup-frac"),
                 ("--model.schedule", "--schedule"), ("--trainer.precision", "--precision"),
                 ("--model.pretrained", "--pretrained"))
# the recipes' fixes that name an option the sweep does not have
_RECIPE_FIXES = ((": add text, lower --data.seq_len or change --data.val_fraction.", ": add text to --path."),
                 (", or lower --data.seq_len.", "."))
QUICK_NOTE = ("--quick runs one seed per cell, so every claim of its report is inconclusive by construction "
              "(a verdict needs at least 2 seeds of every cell a claim compares; the full grid runs 3)")
LOCK_NOTE = ("A sweep holds a lock on its shard of --out while it runs: a second sweep into the same --out and an "
             "overlapping shard refuses to start and names the other process; a lock left by a process that "
             "died is reported as stale and taken over.")


def usable_cpus() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def in_sweep_terms(message: str, kind: Optional[Sweep] = None) -> str:
    """A recipe's or data module's message with its option names replaced by this command's."""
    for recipe, ours in _RECIPE_FIXES:
        message = message.replace(recipe, ours)
    message = re.sub(r"--data\.seq_len\b", "--seq-len", message)
    for recipe, ours in _RECIPE_FLAGS:
        message = message.replace(recipe, ours)
    if kind is not None:
        message = re.sub(r"--model\.(qk_)?norm\b", kind.flag, message)
    return message


def _list(values: Sequence[Any]) -> str:
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _flag(value: bool) -> str:
    return "on" if value else "off"


class _OneLineParser(argparse.ArgumentParser):
    """A command-line mistake is one ``error: ...`` line on stderr and exit status 2, not the usage."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        sys.exit(report(UsageError(f"{message} (options: --help)")))


def _parser(kinds: Mapping[str, Sweep], default: str) -> argparse.ArgumentParser:
    def per_kind(show: Callable[[Sweep], str]) -> str:
        return "(default: " + "; ".join(f"--sweep {k.name}: {show(k)}" for k in kinds.values()) + ")"

    def axis(key: str) -> Callable[[Sweep], str]:
        return lambda k: _list(k.grid[key]) + (f" (--quick: {_list(k.quick[key])})" if key in k.quick else "")

    def per_dataset(key: str, show: Callable[[Any], str] = repr) -> str:
        def one(kind: Sweep) -> str:
            def value(d: Mapping[str, Any]) -> str:
                if key == "epochs" and d.get("max_steps"):
                    return f"none (--max-steps {d['max_steps']})"
                return "required" if d[key] is None and key == "epochs" else show(d[key])

            return "; ".join(f"{name} {value(d)}"
                             for name, d in kind.datasets.items())

        return "(default: per sweep and dataset: " + " | ".join(f"{k.name}: {one(k)}" for k in kinds.values()) + ")"

    def where_set(key: str) -> str:  # a default only some kinds have, the same for each of their datasets
        return "(default: " + "; ".join(f"--sweep {k.name} {k.datasets[k.default_dataset][key]}" for k in kinds.values()
                                        if key in k.datasets.get(k.default_dataset, {})) + ")"

    p = _OneLineParser(
        description="A stress sweep (arms x learning rates x batch sizes x seeds) through recipes/cifar100.py's "
                    "classifier, with computed verdicts on the claims: results.csv, robustness.csv, results.md and "
                    "results.png in --out. " + " ".join(f"--sweep {k.help}." for k in kinds.values())
                    + f" {QUICK_NOTE[0].upper()}{QUICK_NOTE[1:]}; rerun without --quick for verdicts. Every cell's "
                    "settings are checked (data and model built once per distinct setting) before the first cell "
                    "runs; a finished cell is kept and a rerun resumes. " + LOCK_NOTE,
    )
    g = p.add_argument_group("grid")
    g.add_argument("--sweep", choices=list(kinds), default=default,
                   help="; ".join(k.help for k in kinds.values()) + f" (default: {default})")
    for kind in kinds.values():
        g.add_argument(kind.flag, nargs="+", choices=list(kind.arms),
                       help=f"{kind.arms_help} (default: {_list(kind.grid['arms'])})")
    g.add_argument("--lrs", nargs="+", type=float, help="peak learning rates " + per_kind(axis("lrs")))
    g.add_argument("--batch-sizes", nargs="+", type=int, help=per_kind(axis("batch_sizes")))
    g.add_argument("--seeds", nargs="+", type=int, help=per_kind(axis("seeds")))
    g.add_argument("--quick", action="store_true",
                   help="a coarse look in a few minutes: the smaller grid and budget marked --quick, into its own "
                        f"--out; {QUICK_NOTE} (default: off)")
    b = p.add_argument_group("training")
    budget = b.add_mutually_exclusive_group()
    quick_epochs = "; ".join(f"{k.name} {k.quick['epochs']['digits']}" for k in kinds.values()
                             if "digits" in k.quick.get("epochs", {}))
    budget.add_argument("--epochs", type=int, help="training epochs per cell " + per_dataset("epochs", str)[:-1]
                        + f"; --quick on digits: {quick_epochs})")
    budget.add_argument("--max-steps", type=int, help="optimizer steps per cell, instead of --epochs (default: unset; language-model sweeps: "
                        + "; ".join(f"--sweep {k.name} {d['max_steps']}"
                                    + (f" (--quick: {k.quick['max_steps'][n]})" if n in k.quick.get("max_steps", {})
                                       else "") for k in kinds.values() for n, d in k.datasets.items()
                                    if d.get("max_steps") and n == k.default_dataset) + ")")
    b.add_argument("--warmup-frac", type=float,
                   help="linear warm-up share of the steps; 0: the stress hits the peak lr at once "
                        + per_kind(lambda k: f"{k.warmup_frac:g}"))
    b.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="lr schedule after the warm-up, stepped per optimizer step (default: cosine)")
    b.add_argument("--weight-decay", type=float,
                   help="weight decay " + per_kind(lambda k: f"{k.weight_decay:g} ({k.optimizer})"))
    b.add_argument("--log-every", type=int, default=10,
                   help="log and capture the monitors' statistics every N steps (default: 10)")
    b.add_argument("--val-every", type=int, help="validate every N steps, always also at the end (default: every epoch)")
    b.add_argument("--limit-val-batches", type=float, default=1.0,
                   help="fraction (<= 1) or number (> 1) of validation batches (default: 1.0, all)")
    d = p.add_argument_group("data and model")
    d.add_argument("--dataset", choices=list(DATASETS),
                   help="digits: scikit-learn's bundled 8x8 handwritten digits (offline); folder: your images in "
                        "--root (DIR/train/<class>/* and DIR/val/<class>/*, or DIR/<class>/* with 20 %% of each class "
                        "held out, split seed 0: the recipe's folder dataset); synthetic: the offline "
                        "CIFAR-100-shaped stand-in; language-model sweeps: stdlib (the Python standard library's "
                        "sources) or text (your UTF-8 text files in --path) "
                        + per_kind(lambda k: k.default_dataset))
    d.add_argument("--root",
                   help="CIFAR-100 directory, downloaded there when missing; with --dataset folder, the image folder "
                        "(the image recipe's --data.root) (default: data)")
    d.add_argument("--path",
                   help="with --dataset text: the text file or folder (lm.py's --data.path; --root, its older name, "
                        "still works) (default: no text; --dataset text requires it)")
    d.add_argument("--seq-len", type=int,
                   help="language-model sweeps: tokens (bytes, or the --pretrained tokenizer's tokens) per window "
                        + where_set("seq_len"))
    d.add_argument("--pretrained",
                   help="--sweep convert: your own checkpoint (a save_pretrained directory with its tokenizer) as the "
                        "base model, instead of the Llama the sweep trains and caches (default: none)")
    d.add_argument("--base-steps", type=int,
                   help="--sweep convert: optimizer steps of the base model it trains once with its own RMSNorms "
                        "and caches " + where_set("base_steps"))
    d.add_argument("--image-size", type=int, help="images resized to this height and width " + per_dataset("image_size"))
    d.add_argument("--augment", action=argparse.BooleanOptionalAction,
                   help="training augmentation of the data module " + per_dataset("augment", _flag))
    d.add_argument("--arch", help="the model: --sweep norm and qk, a torchvision/timm model that recipes/cifar100.py "
                                  "takes (a ViT without an img_size in --arch-kwargs gets --image-size); --sweep lm and "
                                  "lm-qk, a transformers model_type with a causal-LM head (llama, gpt2, qwen3, ...) "
                                  + per_dataset("arch"))
    d.add_argument("--arch-kwargs", type=json.loads,
                   help="JSON dict of model-builder arguments; the per-dataset default applies only to the "
                        "default --arch " + per_dataset("arch_kwargs", json.dumps))
    d.add_argument("--cifar-stem", action=argparse.BooleanOptionalAction,
                   help="3x3 stride-1 stem without max-pool for ResNets " + per_dataset("cifar_stem", _flag))
    d.add_argument("--synthetic-train-size", type=int, help="training images of synthetic (default: 50000)")
    d.add_argument("--synthetic-val-size", type=int, help="validation images of synthetic (default: 10000)")
    r = p.add_argument_group("running")
    r.add_argument("--accelerator", help="Lightning accelerator " + per_dataset("accelerator", str))
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
    r.add_argument("--out", help="output directory; a rerun resumes it; locked while a sweep runs in it (see above) "
                                 "(default: runs/<stress or stress_<sweep>>_<dataset>, _quick appended with --quick)")
    return p


def _shard(text: str) -> Optional[tuple[int, int]]:
    parts = text.split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return None
    k, n = int(parts[0]), int(parts[1])
    return (k, n) if n >= 1 and 0 <= k < n else None


def _repeated(values: Sequence[Any], same: Callable[[Any, Any], bool]) -> Optional[Any]:
    for i, v in enumerate(values):
        if any(same(v, w) for w in values[:i]):
            return v
    return None


def parse_args(argv: Optional[list[str]] = None, kinds: Optional[Mapping[str, Sweep]] = None) -> argparse.Namespace:
    """Parse ``argv``, fill the kind's, the dataset's and ``--quick``'s defaults; user mistakes exit 2.

    ``kinds``: the sweep kinds to offer (default: :data:`recipes.sweeps.kinds.SWEEPS`).
    ``args.sweep`` becomes the :class:`~recipes.sweeps.kind.Sweep`, ``args.arms`` the values of its
    arm option (``args.norms``, ``args.qk_norms``, ..., filled too).
    """
    if kinds is None:
        from recipes.sweeps.kinds import DEFAULT, SWEEPS

        kinds, default = SWEEPS, DEFAULT
    else:
        default = next(iter(kinds))
    p = _parser(kinds, default)
    args = p.parse_args(argv)
    sweep = kinds[args.sweep]
    for other in kinds.values():
        if other.flag != sweep.flag and getattr(args, other.dest) is not None:
            p.error(f"{other.flag} is an option of --sweep {other.name}; --sweep {sweep.name} varies {sweep.flag}")
    if getattr(args, sweep.dest) is None:
        setattr(args, sweep.dest, list(sweep.grid["arms"]))
    args.arms = getattr(args, sweep.dest)
    for key in AXES:
        if getattr(args, key) is None:
            setattr(args, key, list(sweep.quick[key]) if args.quick and key in sweep.quick else list(sweep.grid[key]))
    for flag, values, same in ((sweep.flag, args.arms, str.__eq__), ("--lrs", args.lrs, same_lr),
                               ("--batch-sizes", args.batch_sizes, int.__eq__), ("--seeds", args.seeds, int.__eq__)):
        twice = _repeated(values, same)
        if twice is not None:
            p.error(f"{flag} lists {twice:g} more than once: give each value once" if isinstance(twice, float)
                    else f"{flag} lists {twice} more than once: give each value once")
    if args.dataset is None:
        args.dataset = sweep.default_dataset
    if args.dataset not in sweep.datasets:
        p.error(f"--sweep {sweep.name} has no defaults for --dataset {args.dataset}; choose one of "
                f"{list(sweep.datasets)}")
    defaults = sweep.datasets[args.dataset]
    if args.path is not None and args.dataset != "text":
        p.error(f"--path is the text of --dataset text; --dataset {args.dataset} reads --root")
    if args.dataset == "text":  # one name with lm.py (--data.path); --root was the sweep's name for it
        if args.path is not None and args.root is not None:
            p.error("--path and --root both name the text; give --path only")
        if args.root is not None:
            print("note: --root for --dataset text is now --path (as lm.py's --data.path); --root still works",
                  file=sys.stderr)
        args.root = args.path if args.path is not None else args.root
        if args.root is None:
            p.error("--dataset text needs --path FILE_OR_DIR (your UTF-8 text files)")
    args.root = "data" if args.root is None else args.root
    base_steps_given = args.base_steps is not None
    for flag, key in (("--seq-len", "seq_len"), ("--base-steps", "base_steps")):
        given = getattr(args, key)
        if given is not None and key not in defaults:
            p.error(f"{flag} is an option of " + " and ".join(f"--sweep {k.name}" for k in kinds.values()
                                                              if key in k.datasets.get(k.default_dataset, {})))
        if given is not None and given < 1:
            p.error(f"{flag} must be >= 1, got {given}")
        if given is None:
            setattr(args, key, defaults.get(key))
    if args.pretrained is not None:
        if "base_steps" not in defaults:
            p.error(f"--pretrained is an option of --sweep convert; --sweep {sweep.name} trains its own models")
        for flag, value in (("--arch", args.arch), ("--arch-kwargs", args.arch_kwargs)):
            if value is not None:
                p.error(f"{flag} conflicts with --pretrained {args.pretrained!r}: the model is the checkpoint's; drop "
                        f"{flag}")
        if base_steps_given:
            p.error(f"--base-steps trains the sweep's own base model; with --pretrained {args.pretrained!r} the "
                    "checkpoint is the base: drop --base-steps")
    custom_arch = args.arch is not None and args.arch != defaults["arch"]
    given_kwargs = args.arch_kwargs is not None
    for key in PER_DATASET:
        if getattr(args, key) is None:
            value = None if key == "arch_kwargs" and custom_arch else defaults[key]  # another model's arguments
            setattr(args, key, dict(value) if isinstance(value, dict) else value)
    if not given_kwargs and args.arch_kwargs and "img_size" in args.arch_kwargs:
        args.arch_kwargs["img_size"] = args.image_size  # the default ViT takes the data's size
    for key in ("weight_decay", "warmup_frac"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(sweep, key))
    if args.epochs is None and args.max_steps is None and defaults.get("max_steps"):  # a stream: steps, not epochs
        quick = sweep.quick.get("max_steps", {}).get(args.dataset) if args.quick else None
        args.max_steps = quick or defaults["max_steps"]
    if args.epochs is None and args.max_steps is None:
        args.epochs = sweep.quick.get("epochs", {}).get(args.dataset) if args.quick else None
        args.epochs = args.epochs or defaults["epochs"]
        if args.epochs is None:
            p.error(f"--epochs or --max-steps is required for --dataset {args.dataset}")
    if args.out is None:
        args.out = os.path.join("runs", f"{sweep.out_stem}_{args.dataset}" + ("_quick" if args.quick else ""))
    for name in ("epochs", "max_steps", "log_every", "val_every", "image_size", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if any(bs < 1 for bs in args.batch_sizes):
        p.error(f"--batch-sizes must all be >= 1, got {_list(args.batch_sizes)}")
    if args.arch_kwargs is not None and not isinstance(args.arch_kwargs, dict):
        p.error(f"--arch-kwargs must be a JSON object such as '{{\"depth\": 4}}', got {json.dumps(args.arch_kwargs)}")
    size = (args.arch_kwargs or {}).get("img_size")
    if size is not None and size != args.image_size:  # a ViT takes one input size only
        p.error(f"--image-size {args.image_size} does not fit the model's img_size {size} (--arch-kwargs): "
                "give both the same size")
    if not 0.0 <= args.warmup_frac < 1.0:
        p.error(f"--warmup-frac must lie in [0, 1), got {args.warmup_frac}")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if any(not lr > 0 or not math.isfinite(lr) for lr in args.lrs):
        p.error(f"--lrs must all be > 0, got {_list(args.lrs)}")
    shard = _shard(args.shard)
    if shard is None:
        p.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    args.shard_k, args.shard_n = shard
    if args.jobs is None:
        args.jobs = usable_cpus() if args.accelerator == "cpu" else 1
    args.sweep = sweep
    return args
