"""The resumable grid of a stress sweep: which cells to run, in how many processes, and what is kept.

``main``: parse the command line (:mod:`recipes.sweeps.cli`), skip the cells already in ``--out``
(``cells/<cell>.json``), check every remaining cell's settings before the first one runs
(:mod:`recipes.sweeps.cells.image_checks`; a mistake writes nothing), refuse an ``--out`` that holds other
settings, take the lock of this shard (:mod:`recipes.sweeps.lock`), then train the cells in this
process or ``--jobs`` worker processes, writing each record atomically as it finishes and the
report (:mod:`recipes.sweeps.report`) after every cell. A finished cell is always kept, also when
another fails or Ctrl-C stops the sweep (exit status 130, the same for every ``--jobs``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

# Keep this import list light: a rerun with nothing left to train must not pay for torch/Lightning.
from recipes.common.errors import UsageError, report
from recipes.sweeps import report as outputs
from recipes.sweeps import settings as st
from recipes.sweeps.cli import in_sweep_terms, parse_args, usable_cpus
from recipes.sweeps.kind import Sweep
from recipes.sweeps.lock import OutLock
from recipes.sweeps.records import load_records, write_atomic

__all__ = ["machine", "main", "run"]

_FIGURE_EVERY_S = 120.0  # redrawing results.png after every cell would cost minutes over a sweep
Cell = tuple[str, float, int, int]  # arm, lr, batch size, seed


def _cpu_model() -> str:
    """The CPU's model name and architecture, e.g. ``AMD EPYC (x86_64)``."""
    import platform

    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:  # not Linux
        pass
    name = name or platform.processor() or "unknown CPU"
    return f"{name} ({platform.machine()})"


def machine(accelerator: Optional[str] = "cpu") -> dict[str, Any]:
    """What a cell runs on: ``device`` (``cpu`` or the GPU's name), ``cpu_model``, ``cpu_isa`` (the vector
    instructions torch's CPU kernels use, e.g. ``AVX2``), ``threads`` (torch's intra-op threads)."""
    import torch

    gpu = accelerator not in ("cpu", None) and torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "cpu_model": _cpu_model(),
            "cpu_isa": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def _work(args: argparse.Namespace, out: Path, cell: Cell) -> dict[str, Any]:
    """Train one cell (in this process or a pool worker); its record with wall and CPU seconds and the machine."""
    run_cell = args.sweep.load("runner")  # torch, Lightning: only where a cell trains
    arm, lr, bs, seed = cell
    start, cpu = time.monotonic(), time.process_time()
    record = run_cell(args, out, args.sweep.cell_name(*cell), arm=arm, lr=lr, batch_size=bs, seed=seed)
    record["wall_s"] = round(time.monotonic() - start, 2)
    record["cpu_s"] = round(time.process_time() - cpu, 2)  # this process's CPU time, all its threads
    record.update(machine(args.accelerator))  # the kernels round differently per CPU: a result says where it ran
    return record


def _init_worker(threads: int) -> None:
    import signal

    import torch

    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool


def _records(args: argparse.Namespace, out: Path, todo: list[Cell]) -> Iterator[dict[str, Any]]:
    """The records of ``todo`` as they finish: in this process, or ``--jobs`` worker processes.

    When a cell fails, no new cell starts, the cells already running finish and are yielded, then
    the first error is raised.
    """
    jobs = min(args.jobs, len(todo))
    if jobs <= 1:
        for cell in todo:
            yield _work(args, out, cell)
        return
    threads = max(1, usable_cpus() // jobs)
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch/OpenMP state
    pool = ProcessPoolExecutor(jobs, mp_context=context, initializer=_init_worker, initargs=(threads,))
    pending: set[Future] = {pool.submit(_work, args, out, cell) for cell in todo}
    failure: Optional[BaseException] = None
    try:
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                if future.cancelled():
                    continue
                error = future.exception()
                if error is None:
                    yield future.result()
                elif failure is None:
                    failure = error
                    for other in pending:
                        other.cancel()  # the running ones go on and are kept
        if failure is not None:
            raise failure
    except BaseException:  # Ctrl-C, or the consumer stopped: stop the workers, keep what was written
        for future in pending:
            future.cancel()
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


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


def _line(record: dict[str, Any], kind: Sweep) -> str:
    row, score = kind.row(record), kind.score
    best = score.best(row)
    return (f"{record['cell']}: final {score.label} {score.show(score.final(row))}{score.unit}, best "
            f"{score.show(best if best is not None else math.nan)}{score.unit}"
            + (f", DIVERGED at step {record['divergence_step']}" if record["diverged"] else "")
            + kind.progress_note(record) + f" ({record['wall_s']:.0f} s, {record['cpu_s']:.0f} s CPU)")


def main(argv: Optional[list[str]] = None, kinds: Optional[Mapping[str, Sweep]] = None) -> int:
    """Run (or resume) the sweep of ``argv``; ``kinds``: the sweep kinds offered (default: the registry)."""
    args = parse_args(argv, kinds)
    kind: Sweep = args.sweep
    out = Path(args.out)
    grid = list(itertools.product(args.arms, args.lrs, args.batch_sizes, args.seeds))
    if kind.keep is not None:
        grid = [c for c in grid if kind.keep(c, args)]
    mine = [c for i, c in enumerate(grid) if i % args.shard_n == args.shard_k]
    done = {r["cell"] for r in load_records(out)} if (out / "cells").is_dir() else set()
    todo = [c for c in mine if kind.cell_name(*c) not in done]
    settings = st.sweep_settings(args)
    old = st.load(out)
    if old is not None and st.changed(old, settings):
        raise UsageError(f"{out} holds a sweep with other settings ({st.changed(old, settings)}): use another "
                         "--out, or the same settings to resume that sweep.")
    data = None
    if todo:
        check_cells = kind.load("checker")  # torch, Lightning: only when there is work
        try:
            data = check_cells(args, todo)
        except UsageError as err:
            raise UsageError(in_sweep_terms(str(err), kind)) from None
    command = " ".join(["python", "recipes/stress.py", *(argv if argv is not None else sys.argv[1:])])
    out.mkdir(parents=True, exist_ok=True)  # nothing is written before every check passed
    with OutLock(out, args.shard_k, args.shard_n) as lock:
        for who in lock.stale:
            print(f"note: a stale lock on {out} ({who}, no longer running) was taken over", flush=True)
        (out / "cells").mkdir(exist_ok=True)
        if old is None:
            write_atomic(out / st.SETTINGS_FILE, json.dumps(settings, indent=2) + "\n")
        if data is not None:
            write_atomic(out / outputs.DATA_FILE, json.dumps(data, indent=2) + "\n")
        jobs = min(args.jobs, max(1, len(todo)))
        print(f"stress sweep: {len(grid)} cells in the grid, {len(mine) - len(todo)} of this shard already done, "
              f"{len(todo)} to run ({jobs} at a time) -> {out}", flush=True)
        if todo:
            line, close = _progress(len(todo))
            last_figure = time.monotonic()
            try:
                for i, record in enumerate(_records(args, out, todo), 1):
                    record["command"] = command
                    write_atomic(out / "cells" / f"{record['cell']}.json", json.dumps(record) + "\n")
                    figure = time.monotonic() - last_figure > _FIGURE_EVERY_S
                    outputs.write_outputs(out, kind, settings, command, figure=figure)  # current after every cell
                    last_figure = time.monotonic() if figure else last_figure
                    line(f"[{i}/{len(todo)}] " + _line(record, kind))
            finally:
                close()
                outputs.write_outputs(out, kind, settings, command, figure=False)
        outputs.write_outputs(out, kind, settings, command)
    print(f"wrote {out / 'results.md'} (claims, robustness, per-cell table), {out / 'results.csv'}, "
          f"{out / 'robustness.csv'}, {out / 'results.png'}; TensorBoard: tensorboard --logdir {out / 'tb'}")
    return 0


def run(argv: Optional[list[str]] = None, kinds: Optional[Mapping[str, Sweep]] = None) -> int:
    """:func:`main` with a user mistake as one ``error:`` line (exit 2) and Ctrl-C as a resumable
    interruption (exit 130)."""
    try:
        return main(argv, kinds)
    except UsageError as err:
        return report(err)
    except KeyboardInterrupt:
        print("\ninterrupted: finished cells are kept; rerun the same command to resume.", file=sys.stderr)
        return 130
