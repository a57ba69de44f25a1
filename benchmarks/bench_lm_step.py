"""Time one training step of a small Hugging Face Llama on the CPU, by norm layer.

The model is a transformers ``LlamaForCausalLM`` built from a config (nothing downloaded):
4 layers, width 128 (4 heads of 32, MLP 512), a byte vocabulary (256), trained on batches of
32 sequences of 128 bytes with AdamW. Variants:

* ``llama``: the model's own ``LlamaRMSNorm`` (the denominator of the ratios);
* ``rms``: every norm replaced by ``nn.RMSNorm`` (``swap_norms(model, target="rms")``);
* ``mrs``: every norm replaced by ``MRSNorm`` (``swap_norms(model, target="mrs")``);
* ``mrs-formula`` (not run by default): ``mrs`` with ``backend="eager"``, the reference formula
  (under ``--compile``: Inductor's own code for it, the compiled path before the custom op);
* ``mrs-python-ops`` (not run by default; under ``--compile``): ``mrs`` with the fallback operator
  pair of ``lightning_mrs.ops.library`` asked for ``cpp``, whose Python body runs the same C++
  operators (``bench_compiled_norm.PythonOpsMRSNorm``, a subclass of ``MRSNorm``, so that Dynamo
  does not hand it the graph traced for ``mrs``).

The swaps go through :func:`lightning_mrs.swap_norms`; a swap that converts nothing (or
leaves a ``LlamaRMSNorm`` behind) stops the benchmark with an error rather than timing the
unchanged model. The steps of all variants are interleaved in one process, in a random order
each round (``interleave.py``; median and fastest of the rounds), so that machine noise hits
them alike.

Usage::

    python benchmarks/bench_lm_step.py                # 9 rounds
    python benchmarks/bench_lm_step.py --quick        # 3 rounds, a minute or two
    python benchmarks/bench_lm_step.py --threads 1 --rounds 15 --json lm_step.json
    python benchmarks/bench_lm_step.py --compile --batch 16 --rounds 7 --variants llama mrs mrs-formula
    python benchmarks/bench_lm_step.py --compile --split   # forward, backward, optimizer apart too
    python benchmarks/bench_lm_step.py --compile --dtype bfloat16   # the models (and norms) in bfloat16

``--compile`` wraps each model's forward in ``torch.compile(model.forward, fullgraph=True)``
(the loss is computed inside it; the backward is Inductor's too). The warm-up steps pay the
compiles, so they are not timed; a graph break raises (``fullgraph``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import ratio_interval, time_steps  # noqa: E402 - the sibling helper
from bench_compiled_norm import PythonOpsMRSNorm  # noqa: E402
from machine import cpu_line  # noqa: E402

from lightning_mrs import swap_norms  # noqa: E402

VARIANTS = {"llama": None, "rms": "rms", "mrs": "mrs", "mrs-formula": "mrs", "mrs-python-ops": "mrs"}  # -> swap target
DEFAULT_VARIANTS = ["llama", "rms", "mrs"]


def build(variant: str, layers: int, width: int, seq: int,
          dtype: torch.dtype = torch.float32) -> tuple[nn.Module, str]:
    """The seeded model of ``variant`` in ``dtype`` (parameters and activations) and a description
    of its norm layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    config._attn_implementation = "eager"  # the same maths on every machine
    model = LlamaForCausalLM(config).to(dtype).train()
    target = VARIANTS[variant]
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    if target is None:
        return model, f"{len(norms)} x LlamaRMSNorm (transformers)"
    report = swap_norms(model, target=target)
    left = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    if not report.converted or left:
        raise RuntimeError(
            f"swap_norms(model, target={target!r}) converted {len(report.converted)} of the {len(norms)} "
            f"LlamaRMSNorm layers (left: {left[:3]}); the benchmark would time the unchanged model.\n{report}"
        )
    kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n in report.converted})
    how = f"{len(report.converted)} x {', '.join(kinds)} (swap_norms target={target!r})"
    converted = [m for n, m in model.named_modules() if n in report.converted]
    if variant == "mrs-formula":  # the reference formula: what Inductor compiled before the custom op
        for m in converted:
            m.backend = "eager"
        how += ", backend='eager'"
    if variant == "mrs-python-ops":
        for m in converted:
            m.__class__ = PythonOpsMRSNorm
        how += ", the fallback pair's Python body around the C++ operators"
    return model, how


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (median)")
    p.add_argument("--steps", type=int, default=2, help="steps per model per round")
    p.add_argument("--quick", action="store_true", help="3 rounds of 1 step")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                   help="mrs-formula: MRSNorm with backend='eager' (the plain formula; under --compile "
                   "what Inductor fuses itself)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the models' dtype (parameters and activations; the norms run in it)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None, help="write the raw figures to this file")
    p.add_argument("--compile", action="store_true", help="torch.compile(model.forward, fullgraph=True)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: process CPU time (steadier on a shared machine)")
    p.add_argument("--split", action="store_true",
                   help="also time the forward (with the loss), the backward and the optimizer step apart")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import transformers  # noqa: F401
    except ImportError:
        p.error("this benchmark needs transformers: pip install 'lightning-mrs[hf]'")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq), generator=g)  # bytes
    models, opts, how = {}, {}, {}
    for v in args.variants:
        models[v], how[v] = build(v, args.layers, args.width, args.seq, getattr(torch, args.dtype))
        opts[v] = torch.optim.AdamW(models[v].parameters(), lr=1e-3)
        if args.compile:
            models[v].forward = torch.compile(models[v].forward, fullgraph=True)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    phases: dict[str, list[tuple[float, float, float]]] = {v: [] for v in models}  # (forward, backward, optimizer) s

    def step(v: str) -> None:
        t0 = clock()
        opts[v].zero_grad(set_to_none=True)
        loss = models[v](input_ids=tokens, labels=tokens).loss
        t1 = clock()
        loss.backward()
        t2 = clock()
        opts[v].step()
        phases[v].append((t1 - t0, t2 - t1, clock() - t2))

    warmup = 2  # untimed steps per model first: the compiles, the allocator
    times = time_steps(step, list(models), args.rounds, args.steps, warmup=warmup, clock=clock)  # a random order each round
    med = {v: statistics.median(t) for v, t in times.items()}
    best = {v: min(t) for v, t in times.items()}
    base = "llama" if "llama" in med else next(iter(models))
    mode = "compiled (fullgraph)" if args.compile else "eager"
    print(f"Llama train step (AdamW, {mode}, {args.dtype}): {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} "
          f"bytes; {torch.get_num_threads()} threads, {args.clock} clock, torch {torch.__version__}, transformers "
          f"{sys.modules['transformers'].__version__}; median of {args.rounds} interleaved rounds x {args.steps} steps")
    print(cpu_line())
    w = max(6, *map(len, models))  # the variant names' column
    paired = {v: ratio_interval(times[v], times[base]) for v in models}
    print(f"{'norm':{w}s} {'median ms':>10s} {'x ' + base:>9s} {'min ms':>9s} {'min x':>7s} "
          f"{'paired x [95%]':>22s}  layers")
    for v in models:
        r, lo, hi = paired[v]
        print(f"{v:{w}s} {med[v] * 1e3:10.1f} {med[v] / med[base]:9.3f} {best[v] * 1e3:9.1f} "
              f"{best[v] / best[base]:7.3f} {r:7.3f} [{lo:.3f}, {hi:.3f}]  {how[v]}")
    print(f"paired x: the median of the per-round ratios to {base}, with a bootstrap 95 % interval "
          "(an interval that holds 1.0 is a tie within this run's noise)")
    split = {}
    if args.split:  # the timed steps only; step i of every variant ran in the same round
        timed = {v: list(zip(*calls[warmup:])) for v, calls in phases.items()}  # phase -> per-step seconds
        split = {v: [statistics.median(t) for t in ph] for v, ph in timed.items()}
        print(f"\nper phase, median of the {args.rounds * args.steps} timed steps (ms, paired x {base} [95%])")
        print(f"{'norm':{w}s} {'forward':>30s} {'backward':>30s} {'optimizer':>30s}")
        for v, ph in timed.items():
            cells = []
            for t, b in zip(ph, timed[base]):
                r, lo, hi = ratio_interval(t, b)
                cells.append(f"{statistics.median(t) * 1e3:7.2f} {r:6.3f} [{lo:.3f}, {hi:.3f}]")
            print(f"{v:{w}s} " + " ".join(f"{c:>30s}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "median_s": med,
                       "all_s": times, "layers": how, "phase_median_s": split,
                       "paired_ratio_interval": paired}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
