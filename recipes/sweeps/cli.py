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
#: every --dataset, with what its help says of it (a kind's help lists the ones it takes)
DATASETS = {"digits": "digits (scikit-learn's 8x8 scans, offline)", "cifar100": "cifar100",
            "folder": "folder (your images in --root: DIR/train/<class>/*, DIR/val/<class>/*, or DIR/<class>/* split "
                      "80/20)",
            "synthetic": "synthetic (offline)", "stdlib": "stdlib (Python's own sources)", "text": "text (--path)"}
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
LOCK_NOTE = "A second sweep into a running sweep's --out refuses to start and names it; a dead sweep's lock is free."


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


def _checked(kind: Callable[[str], Any], ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)`` that must satisfy ``ok``, else ``argument --x: must be <rule>, got <text>``."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return parse


_COUNT = _checked(int, lambda v: v >= 1, ">= 1")
_LR = _checked(float, lambda v: v > 0 and math.isfinite(v), "> 0")


def _list(values: Sequence[Any]) -> str:
    return " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def _flag(value: bool) -> str:
    return "on" if value else "off"


class _OneLineParser(argparse.ArgumentParser):
    """A command-line mistake is one ``error: ...`` line on stderr and exit status 2, not the usage."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        sys.exit(report(UsageError(f"{message} (options: --help)")))


def _grouped(values: Mapping[str, str]) -> str:
    """``{"a": "1", "b": "2", "c": "2"}`` -> ``a 1; others 2``: each value once, the names listed (--dataset) once.

    The value most names share is the others' (the last such on a tie: the first name stays named); one value for every name is just the value.
    """
    names: dict[str, list[str]] = {}
    for name, value in values.items():
        names.setdefault(value, []).append(name)
    common = max(reversed(list(names)), key=lambda v: len(names[v]))
    return "; ".join([f"{', '.join(n)} {v}" for v, n in names.items() if v != common]
                     + [f"others {common}" if len(names) > 1 else common])


class _Formatter(argparse.HelpFormatter):
    """Lines broken between words only: an arm such as ``rms-half-fp16`` stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _parser(kinds: Mapping[str, Sweep], default: str, shown: Sweep) -> argparse.ArgumentParser:
    """The parser; the help states ``shown``'s defaults (``--sweep KIND --help``: that kind's)."""
    def per_kind(show: Callable[[Sweep], str]) -> str:
        return f"(default: {show(shown)})"

    def axis(key: str) -> Callable[[Sweep], str]:
        return lambda k: _list(k.grid[key]) + (f" (--quick: {_list(k.quick[key])})" if key in k.quick else "")

    def elsewhere(has: Callable[[Sweep], bool]) -> str:  # an option the shown kind does not have: the kinds that do
        return f"(default: none: an option of --sweep {', '.join(k.name for k in kinds.values() if has(k))})"

    def sets(key: str) -> Callable[[Sweep], bool]:  # the kind's datasets give the option a default
        return lambda k: k.datasets.get(k.default_dataset, {}).get(key) is not None

    def takes(dataset: str) -> Callable[[Sweep], bool]:
        return lambda k: dataset in k.datasets

    def unless(has: Callable[[Sweep], bool], text: str) -> str:
        return text if has(shown) else elsewhere(has)

    def per_dataset(key: str, show: Callable[[Any], str] = repr) -> str:
        if key != "epochs" and all(d[key] is None for d in shown.datasets.values()):  # an image option, LM sweep
            return elsewhere(sets(key))

        def value(d: Mapping[str, Any]) -> str:
            if key == "epochs" and d.get("max_steps"):
                return f"none (--max-steps {d['max_steps']})"
            return "required" if d[key] is None and key == "epochs" else show(d[key])

        return "(default: " + _grouped({name: value(d) for name, d in shown.datasets.items()}) + ")"

    def where_set(key: str, text: str, default: Optional[str] = None) -> str:  # an option only some kinds have
        value = shown.datasets.get(shown.default_dataset, {}).get(key)
        return elsewhere(sets(key)) if value is None else f"{text} (default: {default or value})"

    p = _OneLineParser(
        formatter_class=_Formatter,
        usage="%(prog)s [--sweep KIND] [ARMS] [--lrs LR ...] [--batch-sizes N ...] [--seeds N ...] [--dataset NAME] "
              "[option ...] [--scheduler ADDRESS | --slurm ...] [--out DIR]",
        description="A stress sweep (arms x learning rates x batch sizes x seeds) with computed verdicts: results.md, "
                    ".csv and .png in --out. Every cell's settings are checked before the first cell runs; each cell "
                    "is a task of a Dask cluster (this machine's by default); a finished cell is kept and a rerun "
                    "resumes. " + QUICK_NOTE.split(" (")[0] + ". " + LOCK_NOTE + f" The defaults shown are --sweep "
                    f"{shown.name}'s; --sweep KIND --help shows another kind's.",
    )
    g = p.add_argument_group("what to sweep")
    g.add_argument("--sweep", choices=list(kinds), default=default, metavar="KIND",
                   help="; ".join(k.help for k in kinds.values()) + f" (default: {default})")
    for kind in kinds.values():
        arms = " ".join(a + "*" * (a in kind.grid["arms"]) for a in kind.arms) + " (default: the arms marked *)"
        g.add_argument(kind.flag, nargs="+", choices=list(kind.arms), metavar="ARM",
                       help=f"{kind.arms_help}: {arms}" if kind is shown else
                       f"(default: listed by --sweep {kind.name} --help)")
    g.add_argument("--lrs", nargs="+", type=_LR, metavar="LR", help="peak learning rates " + per_kind(axis("lrs")))
    g.add_argument("--batch-sizes", nargs="+", type=_COUNT, metavar="N", help=per_kind(axis("batch_sizes")))
    g.add_argument("--seeds", nargs="+", type=int, metavar="N", help=per_kind(axis("seeds")))
    g.add_argument("--quick", action="store_true",
                   help="a coarse look in a few minutes: the smaller grid and budget marked --quick, into its own "
                        "--out; one seed, so no verdicts: rerun without --quick for verdicts (default: off)")
    b = p.add_argument_group("training")
    budget = b.add_mutually_exclusive_group()
    quick_epochs = shown.quick.get("epochs", {}).get("digits")
    budget.add_argument("--epochs", type=_COUNT, metavar="N", help="training epochs per cell " + per_dataset("epochs", str)[:-1]
                        + (f"; --quick on digits: {quick_epochs})" if quick_epochs else ")"))
    steps = shown.datasets.get(shown.default_dataset, {}).get("max_steps")
    quick_steps = shown.quick.get("max_steps", {}).get(shown.default_dataset)
    budget.add_argument("--max-steps", type=_COUNT, metavar="N", help="optimizer steps per cell, instead of --epochs "
                        + (f"(default: {steps}" + (f"; --quick: {quick_steps})" if quick_steps else ")") if steps
                           else "(default: unset)"))
    b.add_argument("--warmup-frac", type=_checked(float, lambda v: 0 <= v < 1, "in [0, 1)"), metavar="F", help="linear warm-up share of the steps; 0: the stress "
                   "hits the peak lr at once " + per_kind(lambda k: f"{k.warmup_frac:g}"))
    b.add_argument("--schedule", choices=["cosine", "constant"], default="cosine", metavar="NAME",
                   help="lr schedule after the warm-up, cosine or constant, stepped per optimizer step (default: cosine)")
    b.add_argument("--weight-decay", type=_checked(float, lambda v: v >= 0, ">= 0"), metavar="F",
                   help="weight decay " + per_kind(lambda k: f"{k.weight_decay:g} ({k.optimizer})"))
    b.add_argument("--log-every", type=_COUNT, default=10, metavar="N",
                   help="log and capture the monitors' statistics every N steps (default: 10)")
    b.add_argument("--val-every", type=_COUNT, metavar="N",
                   help="validate every N steps, always also at the end (default: every epoch)")
    b.add_argument("--limit-val-batches", type=float, default=1.0, metavar="F",
                   help="fraction (<= 1) or number (> 1) of validation batches (default: 1.0, all)")
    d = p.add_argument_group("data and model")
    d.add_argument("--dataset", choices=list(DATASETS), metavar="NAME",
                   help=", ".join(DATASETS[name] for name in shown.datasets) + " " + per_kind(lambda k: k.default_dataset))
    d.add_argument("--root", metavar="DIR", help=unless(takes("cifar100"), "CIFAR-100 directory, downloaded there when "
                   "missing; with --dataset folder, the image folder (default: data)"))
    d.add_argument("--path", metavar="PATH", help=unless(takes("text"), "with --dataset text: the text file or folder "
                   "(lm.py's --data.path) (default: none; --dataset text requires it)"))
    d.add_argument("--seq-len", type=_COUNT, metavar="N", help=where_set("seq_len", "tokens per window"))
    d.add_argument("--pretrained", metavar="DIR", help=where_set(
        "base_steps", "your own checkpoint (a save_pretrained directory with its tokenizer) as the base model",
        "none, the sweep trains and caches one"))
    d.add_argument("--base-steps", type=_COUNT, metavar="N", help=where_set(
        "base_steps", "optimizer steps of the base model the sweep trains once with its own RMSNorms and caches"))
    d.add_argument("--image-size", type=_COUNT, metavar="N",
                   help="images resized to this height and width " + per_dataset("image_size"))
    d.add_argument("--augment", action=argparse.BooleanOptionalAction,
                   help="training augmentation " + per_dataset("augment", _flag))
    d.add_argument("--arch", metavar="NAME", help=("a transformers model_type with a causal-LM head (llama, gpt2, "
                   "qwen3, ...) " if "text" in shown.datasets else "a torchvision/timm model that recipes/cifar100.py "
                   "takes ") + per_dataset("arch"))
    d.add_argument("--arch-kwargs", type=json.loads, metavar="JSON",
                   help="model-builder arguments; the per-dataset default applies only to the default --arch "
                        + per_dataset("arch_kwargs", json.dumps))
    d.add_argument("--cifar-stem", action=argparse.BooleanOptionalAction,
                   help="3x3 stride-1 stem without max-pool for ResNets " + per_dataset("cifar_stem", _flag))
    d.add_argument("--synthetic-train-size", type=int, metavar="N",
                   help=unless(takes("synthetic"), "training images of synthetic (default: 50000)"))
    d.add_argument("--synthetic-val-size", type=int, metavar="N",
                   help=unless(takes("synthetic"), "validation images of synthetic (default: 10000)"))
    r = p.add_argument_group("where to run")
    r.add_argument("--accelerator", metavar="NAME", help="Lightning accelerator; a GPU cell asks its worker for a GPU "
                   + per_dataset("accelerator", str))
    r.add_argument("--precision", help="(default: 32-true on the CPU; bf16-mixed on GPUs with bf16, else 16-mixed)")
    r.add_argument("--mrs-backend", default="auto", metavar="NAME",
                   help="MRSNorm implementation; same maths (default: auto)")
    r.add_argument("--jobs", type=_COUNT, metavar="N",
                   help="cells at once on this machine, each in a Dask worker process with cpus/N threads or its own "
                        "GPU; 1: in this process (default: the usable CPU cores on the cpu accelerator, else 1)")
    r.add_argument("--num-workers", type=int, metavar="N",
                   help="DataLoader workers per cell (default: 0 on the CPU, else up to 8)")
    c = p.add_argument_group("on a cluster (the [cluster] extra: dask.distributed, dask-jobqueue)")
    where = c.add_mutually_exclusive_group()
    where.add_argument("--scheduler", metavar="ADDRESS", help="a running Dask scheduler (tcp://HOST:PORT) whose "
                       "workers run the cells; waited for as long as Dask's distributed.comm.timeouts.connect "
                       "(docs/recipes.md) (default: none, this machine)")
    where.add_argument("--slurm", action="store_true", help="start workers as SLURM jobs (dask-jobqueue's SLURMCluster), "
                   "one per GPU of a job; the repository and --out on a shared filesystem (default: off)")
    c.add_argument("--slurm-partition", metavar="NAME", help="the partition (default: the cluster's)")
    c.add_argument("--slurm-gpus", type=_checked(int, lambda v: v >= 0, ">= 0"), metavar="N", help="GPUs per job (default: 0)")
    c.add_argument("--slurm-cpus", type=_COUNT, metavar="N", help="CPUs per job (default: 4)")
    c.add_argument("--slurm-time", metavar="HH:MM:SS", help="wall time per job (default: 01:00:00)")
    c.add_argument("--slurm-jobs", type=_COUNT, metavar="N", help="jobs (default: 1)")
    c.add_argument("--slurm-option", action="append", metavar="KEY=VALUE",
                   help="any other SLURMCluster argument, repeatable; VALUE as JSON or text, e.g. account=proj, "
                        "memory=64GB (default: none; memory=16GB)")
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", help="output directory; a rerun resumes it; locked while a sweep runs in it "
                   "(default: runs/<stress or stress_<sweep>>_<dataset>, _quick appended with --quick)")
    o.add_argument("--progress", action="store_true", help="also show Lightning's per-step progress bar (default: off)")
    return p


_SLURM = {"slurm_partition": None, "slurm_gpus": 0, "slurm_cpus": 4, "slurm_time": "01:00:00", "slurm_jobs": 1,
          "slurm_option": []}


def _cluster_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check and fill the cluster options (a mistake is one line naming the option)."""
    given = [k for k in _SLURM if getattr(args, k) is not None]
    if given and not args.slurm:
        p.error(f"--{given[0].replace('_', '-')} is an option of --slurm: add --slurm")
    if (args.slurm or args.scheduler) and args.jobs is not None:
        p.error(f"--jobs sets this machine's worker processes; with {'--slurm' if args.slurm else '--scheduler'} the "
                "cluster's workers run the cells: drop --jobs")
    for key, value in _SLURM.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    bad = next((item for item in args.slurm_option if "=" not in item), None)
    if bad is not None:
        p.error(f"--slurm-option {bad!r}: give KEY=VALUE, e.g. account=proj")
    if args.slurm and args.accelerator in ("gpu", "cuda") and not args.slurm_gpus:
        p.error(f"--accelerator {args.accelerator} with --slurm needs GPUs in the jobs: give --slurm-gpus N")


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
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--sweep")
    asked = pre.parse_known_args(argv)[0].sweep
    p = _parser(kinds, default, kinds.get(asked, kinds[default]))
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
    if args.dataset == "text":  # one name with lm.py (--data.path)
        if args.root is not None:
            p.error("--dataset text reads its text from --path (as lm.py's --data.path), not --root: give --path")
        if args.path is None:
            p.error("--dataset text needs --path FILE_OR_DIR (your UTF-8 text files)")
        args.root = args.path
    args.root = "data" if args.root is None else args.root
    base_steps_given = args.base_steps is not None
    for flag, key in (("--seq-len", "seq_len"), ("--base-steps", "base_steps")):
        given = getattr(args, key)
        if given is not None and key not in defaults:
            p.error(f"{flag} is an option of " + " and ".join(f"--sweep {k.name}" for k in kinds.values()
                                                              if key in k.datasets.get(k.default_dataset, {})))
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
    if args.arch_kwargs is not None and not isinstance(args.arch_kwargs, dict):
        p.error(f"--arch-kwargs must be a JSON object such as '{{\"depth\": 4}}', got {json.dumps(args.arch_kwargs)}")
    size = (args.arch_kwargs or {}).get("img_size")
    if size is not None and size != args.image_size:  # a ViT takes one input size only
        p.error(f"--image-size {args.image_size} does not fit the model's img_size {size} (--arch-kwargs): "
                "give both the same size")
    _cluster_options(p, args)
    if args.jobs is None:
        args.jobs = usable_cpus() if args.accelerator == "cpu" else 1
    args.sweep = sweep
    return args
