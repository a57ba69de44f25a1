"""The resumable grid of a stress sweep: which cells to run, where, and what is kept.

``main`` parses the command line (:mod:`recipes.sweeps.cli`), skips the cells already in ``--out``, checks every
remaining cell's settings before the first runs (a mistake writes nothing), opens the cluster
(:mod:`recipes.sweeps.cluster`; ``--jobs 1`` trains in this process) and locks ``--out``
(:mod:`recipes.sweeps.lock`), then hands the cells to the Dask client. This process alone writes each record as it
arrives, and the report (:mod:`recipes.sweeps.report`) after it. A cell whose worker dies runs again elsewhere (the
scheduler's own rescheduling); a finished cell is kept whatever happens next (Ctrl-C: exit status 130).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pickle
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

# Keep this import list light: a rerun with nothing left to train must not pay for torch/Lightning.
from recipes.common.errors import UsageError, report
from recipes.sweeps import report as outputs
from recipes.sweeps import settings as st
from recipes.sweeps.cli import in_sweep_terms, parse_args, usable_cpus
from recipes.sweeps.kind import Sweep
from recipes.sweeps.lock import out_lock
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


def _work(args: argparse.Namespace, out: Path, cell: Cell, threads: Optional[int] = None,
          gpu: bool = False) -> dict[str, Any]:
    """Train one cell (in this process or on a Dask worker); its record with wall and CPU seconds and the machine.
    ``threads``: torch's intra-op threads (``None``: as the process has them); ``gpu``: a Dask worker's GPU cell,
    which takes a GPU of its own first (:func:`recipes.sweeps.cluster.pin_gpu`)."""
    if gpu:
        from recipes.sweeps.cluster import pin_gpu

        pin_gpu()
    run_cell = args.sweep.load("runner")  # torch, Lightning: only where a cell trains
    if threads is not None:
        import torch

        torch.set_num_threads(threads)  # a Dask worker process starts with OMP_NUM_THREADS=1
    arm, lr, bs, seed = cell
    start, cpu = time.monotonic(), time.process_time()
    record = run_cell(args, out, args.sweep.cell_name(*cell), arm=arm, lr=lr, batch_size=bs, seed=seed)
    record["wall_s"] = round(time.monotonic() - start, 2)
    record["cpu_s"] = round(time.process_time() - cpu, 2)  # this process's CPU time, all its threads
    record.update(machine(args.accelerator))  # the kernels round differently per CPU: a result says where it ran
    return record


def _on_worker(args: argparse.Namespace, out: Path, cell: Cell, threads: Optional[int], gpu: bool) -> dict[str, Any]:
    """:func:`_work` as a Dask task: its record names the worker that ran it."""
    from distributed import get_worker

    return {**_work(args, out, cell, threads, gpu), "worker": get_worker().address}


class _Call:
    """A call made where it is unpickled: ``pickle.loads(pickle.dumps(_Call(f, *args)))`` is ``f(*args)``.

    A cell's task is ``pickle.loads`` of these bytes: the scheduler unpickles every task it receives, and a task
    naming this project's function (or holding its objects, the sweep's settings) unpickles only where the project
    imports; ``pickle.loads`` and bytes unpickle everywhere, so a scheduler started anywhere (``dask scheduler``, as
    docs/recipes.md says) runs the sweep, and only the workers, which train, import the project.
    """

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _task(args: argparse.Namespace, out: Path, cell: Cell, cluster: Any) -> bytes:
    """The cell's :func:`_on_worker` call as bytes (:class:`_Call`), pickled as Dask pickles a task (cloudpickle)."""
    import cloudpickle

    return cloudpickle.dumps(_Call(_on_worker, args, out, cell, cluster.threads, cluster.gpu))


def _records(args: argparse.Namespace, out: Path, todo: list[Cell], cluster: Any) -> Iterator[dict[str, Any]]:
    """The records of ``todo`` as they finish, in this process (``cluster`` None) or as tasks of the Dask client.
    When a cell fails, no new cell starts; the cells already running finish and are yielded; then the error is raised.
    """
    if cluster is None:
        yield from ({**_work(args, out, cell), "worker": "this process"} for cell in todo)
        return
    from distributed import as_completed

    client, token = cluster.client, uuid.uuid4().hex[:8]  # task keys: <cell>@<this sweep>, unique on a shared cluster
    futures = [client.submit(pickle.loads, _task(args, out, cell, cluster), key=f"{args.sweep.cell_name(*cell)}@{token}",
                             resources={"GPU": 1} if cluster.gpu else None) for cell in todo]
    failure: Optional[BaseException] = None
    try:
        for future in as_completed(futures):
            if future.status == "finished":
                yield future.result()
            elif future.status == "error" and failure is None:
                failure = future.exception()
                running = {key for keys in client.processing().values() for key in keys}
                client.cancel([f for f in futures if f.key not in running])
        if failure is not None:
            raise failure
    finally:
        client.cancel(futures)  # Ctrl-C, a failure or the consumer stopped: nothing of this sweep keeps running


def _line(record: dict[str, Any], kind: Sweep) -> str:
    row, score = kind.row(record), kind.score
    best = score.best(row)
    return (f"{record['cell']}: final {score.label} {score.show(score.final(row))}{score.unit}, best "
            f"{score.show(best if best is not None else math.nan)}{score.unit}"
            + (f", DIVERGED at step {record['divergence_step']}" if record["diverged"] else "")
            + kind.progress_note(record) + f" ({record['wall_s']:.0f} s, {record['cpu_s']:.0f} s CPU)")


def _train(args: argparse.Namespace, out: Path, todo: list[Cell], cluster: Any, command: str,
           settings: dict[str, Any]) -> None:
    """Write each cell's record as it arrives, and the report after it."""
    from tqdm.auto import tqdm

    last_figure = time.monotonic()
    with tqdm(total=len(todo), desc="cells", unit="cell", dynamic_ncols=True) as bar:
        try:
            for i, record in enumerate(_records(args, out.resolve() if cluster else out, todo, cluster), 1):
                record["command"] = command
                write_atomic(out / "cells" / f"{record['cell']}.json", json.dumps(record) + "\n")
                figure = time.monotonic() - last_figure > _FIGURE_EVERY_S
                outputs.write_outputs(out, args.sweep, settings, command, figure=figure)  # current after every cell
                last_figure = time.monotonic() if figure else last_figure
                bar.write(f"[{i}/{len(todo)}] " + _line(record, args.sweep))
                bar.update(1)
        finally:
            outputs.write_outputs(out, args.sweep, settings, command, figure=False)


def main(argv: Optional[list[str]] = None, kinds: Optional[Mapping[str, Sweep]] = None) -> int:
    """Run (or resume) the sweep of ``argv``; ``kinds``: the sweep kinds offered (default: the registry)."""
    args = parse_args(argv, kinds)
    kind: Sweep = args.sweep
    out = Path(args.out)
    grid = list(itertools.product(args.arms, args.lrs, args.batch_sizes, args.seeds))
    if kind.keep is not None:
        grid = [c for c in grid if kind.keep(c, args)]
    done = {r["cell"] for r in load_records(out)} if (out / "cells").is_dir() else set()
    todo = [c for c in grid if kind.cell_name(*c) not in done]
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
    jobs = min(args.jobs, max(1, len(todo)))
    cluster = None
    if todo and (jobs > 1 or args.scheduler or args.slurm):  # else this process trains
        from recipes.sweeps.cluster import connect

        cluster = connect(args, jobs, usable_cpus())  # a scheduler that does not answer: nothing written yet
        for name in ("root", "pretrained"):  # a worker elsewhere reads the same files
            if getattr(args, name) is not None and Path(getattr(args, name)).exists():
                setattr(args, name, str(Path(getattr(args, name)).resolve()))
    try:
        out.mkdir(parents=True, exist_ok=True)  # nothing is written before every check passed
        with out_lock(out):
            (out / "cells").mkdir(exist_ok=True)
            if old is None:
                write_atomic(out / st.SETTINGS_FILE, json.dumps(settings, indent=2) + "\n")
            if data is not None:
                write_atomic(out / outputs.DATA_FILE, json.dumps(data, indent=2) + "\n")
            print(f"stress sweep: {len(grid)} cells in the grid, {len(grid) - len(todo)} already done, {len(todo)} to "
                  f"run ({cluster.where if cluster else 'in this process'}) -> {out}", flush=True)
            if todo:
                _train(args, out, todo, cluster, command, settings)
            outputs.write_outputs(out, kind, settings, command)
    finally:
        if cluster is not None:
            cluster.close()
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
