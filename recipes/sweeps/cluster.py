"""Where a sweep's cells run: a ``dask.distributed`` client on an embedded LocalCluster, a running scheduler or SLURM.

:func:`connect` opens the client the options ask for and checks, before any cell runs, what can be known then:
the scheduler answers, its workers import this project, a GPU cell has workers offering a ``GPU`` resource, a
``--slurm-option`` is one dask-jobqueue knows. A GPU cell asks for ``resources={"GPU": 1}``; on its worker
:func:`pin_gpu` gives the worker process a GPU of its own (so a worker process per GPU of a machine each runs
on its own device). Imports torch only to count a local cluster's GPUs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from recipes.common.errors import UsageError

__all__ = ["ROOT", "Cluster", "connect", "pin_gpu", "slurm_kwargs"]

ROOT = Path(__file__).resolve().parents[2]  # the repository root: workers import recipes from there
_EXTRA = 'pip install -e ".[cluster]"'
_GPU_LOCK: Any = None  # the lock on this worker process's own GPU, held while the process lives


def _dask(module: str, flag: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"{flag} needs {module.split('.')[0]} (the [cluster] extra): {_EXTRA}") from None


def _gpu(args: argparse.Namespace) -> bool:
    return args.accelerator in ("gpu", "cuda")


def slurm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """dask-jobqueue ``SLURMCluster`` arguments of the ``--slurm-*`` options: one worker process per GPU of a
    job (one thread each, ``GPU=1``), or one per CPU-only job; ``--slurm-option KEY=VALUE`` passed on as is."""
    processes = max(1, args.slurm_gpus)
    kwargs: dict[str, Any] = dict(
        queue=args.slurm_partition, cores=processes, processes=processes, job_cpu=args.slurm_cpus,
        memory="16GB", walltime=args.slurm_time, python=sys.executable,
        # workers import recipes from the repository (python -m adds the current directory); a cell's DataLoader
        # workers are child processes, which a daemonic worker process may not start
        job_script_prologue=[f"cd {ROOT}", "export DASK_DISTRIBUTED__WORKER__DAEMON=False"],
        job_extra_directives=[f"--gres=gpu:{args.slurm_gpus}"] if args.slurm_gpus else [],
        worker_extra_args=["--resources", "GPU=1"] if args.slurm_gpus else [])
    for item in args.slurm_option or []:
        key, _, text = item.partition("=")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text  # a plain string: account=proj
        if isinstance(kwargs.get(key), list) and isinstance(value, list):
            value = kwargs[key] + value
        kwargs[key] = value
    return kwargs


def _slurm(args: argparse.Namespace) -> Any:
    jobqueue = _dask("dask_jobqueue", "--slurm")
    kwargs = slurm_kwargs(args)
    try:  # the job script alone, as SLURMCluster checks it: no scheduler started yet
        jobqueue.SLURMCluster.job_cls(scheduler="tcp://127.0.0.1:8786", name="check", **kwargs)
    except TypeError as err:
        key = re.search(r"argument '(\w+)'", str(err))
        raise UsageError(f"--slurm-option {key.group(1) if key else err}=...: not an argument of dask-jobqueue's "
                         "SLURMCluster (https://jobqueue.dask.org/en/latest/generated/"
                         "dask_jobqueue.SLURMCluster.html)") from None
    if shutil.which("sbatch") is None:
        raise UsageError("--slurm: no sbatch on this machine: run the sweep on a node of the SLURM cluster")
    cluster = jobqueue.SLURMCluster(**kwargs)
    cluster.scale(jobs=args.slurm_jobs)
    return cluster


def _probe() -> dict[str, Any]:
    """On a worker: what the checks need (this function unpickles only where the project imports)."""
    import multiprocessing

    return {"daemon": multiprocessing.current_process().daemon, "host": socket.gethostname()}


@dataclass
class Cluster:
    """The client, a one-line description, torch's threads per cell (``None``: the worker's own), whether cells ask
    for a GPU, and ``close`` (what was started)."""

    client: Any
    where: str
    threads: Optional[int]
    gpu: bool
    close: Callable[[], Any]


def connect(args: argparse.Namespace, jobs: int, usable_cpus: int) -> Cluster:
    """The cluster of ``--scheduler``, ``--slurm`` or else a LocalCluster of ``jobs`` worker processes."""
    if args.scheduler is None and not args.slurm:
        dask, distributed = _dask("dask", "--jobs"), _dask("distributed", f"--jobs {jobs}")
        gpus = _cuda() if _gpu(args) or args.accelerator == "auto" else 0
        if _gpu(args) and jobs > gpus:
            raise UsageError(f"--jobs {jobs}: a GPU cell needs a GPU of its own and this machine has {gpus}: "
                             f"--jobs {gpus} at most")
        gpu = gpus > 0 and args.accelerator != "cpu"
        # daemon: a cell's DataLoader workers are children of its worker process
        with dask.config.set({"distributed.worker.daemon": False}):
            cluster = distributed.LocalCluster(
                n_workers=jobs, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address="127.0.0.1:0", worker_dashboard_address="127.0.0.1:0",  # HTTP routes: loopback only
                resources={"GPU": 1} if gpu else None, silence_logs=logging.ERROR)
        client = distributed.Client(cluster)
        return Cluster(client, f"{jobs} local worker processes", max(1, usable_cpus // jobs), gpu,
                       lambda: (client.close(), cluster.close()))
    distributed = _dask("distributed", "--scheduler" if args.scheduler else "--slurm")
    if args.slurm:
        cluster = _slurm(args)
        client = distributed.Client(cluster)
        return Cluster(client, f"{args.slurm_jobs} SLURM job(s) from {cluster.scheduler_address}",
                       max(1, args.slurm_cpus // max(1, args.slurm_gpus)), args.slurm_gpus > 0,
                       lambda: (client.close(), cluster.close()))
    from dask import config, utils

    timeout = utils.parse_timedelta(config.get("distributed.comm.timeouts.connect"), "s")
    try:
        client = distributed.Client(args.scheduler, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        reason = "" if "Timed out" in reason else f" ({reason})"
        raise UsageError(f"--scheduler {args.scheduler}: no Dask scheduler answered in {timeout:g} s (Dask's "
                         "distributed.comm.timeouts.connect)"
                         f"{reason}: start one (dask scheduler) or fix the address") from None
    try:
        gpu = _check_workers(args, client, timeout)
    except BaseException:
        client.close()
        raise
    return Cluster(client, f"the Dask scheduler at {args.scheduler}", None, gpu, client.close)


def _check_workers(args: argparse.Namespace, client: Any, timeout: float) -> bool:
    """The running cluster's workers can run the cells; whether the cells ask for a GPU."""
    flag = f"--scheduler {args.scheduler}"
    try:
        client.wait_for_workers(1, timeout=timeout)
    except TimeoutError:
        raise UsageError(f"{flag}: no worker joined in {timeout:g} s: start workers "
                         f"(dask worker {args.scheduler} --nthreads 1, from the repository root)") from None
    for address, probe in client.run(_probe, on_error="return").items():
        if isinstance(probe, BaseException):
            raise UsageError(f"{flag}: worker {address} cannot import this project ({type(probe).__name__}: "
                             f"{probe}): install it there (pip install -e \".[recipes,cluster]\") or start the "
                             "worker from the repository root with python -m distributed.cli.dask_worker")
        if probe["daemon"] and (args.num_workers or args.num_workers is None and args.accelerator != "cpu"):
            given = args.num_workers if args.num_workers is not None else "default (up to 8 off the CPU)"
            raise UsageError(f"--num-workers {given}: worker {address} is a daemonic process, which may "
                             "not start DataLoader workers: start workers with DASK_DISTRIBUTED__WORKER__DAEMON=False "
                             "or use --num-workers 0")
    offered = [w for w in client.scheduler_info()["workers"].values() if w.get("resources", {}).get("GPU")]
    if _gpu(args) and not offered:
        raise UsageError(f"--accelerator {args.accelerator}: no worker of {flag} offers a GPU resource: start GPU "
                         "workers with --resources GPU=1 (one worker process per GPU), or use --accelerator cpu")
    return _gpu(args) or (args.accelerator == "auto" and bool(offered))


def _cuda() -> int:
    import torch

    return torch.cuda.device_count()


def pin_gpu() -> None:
    """Give this worker process a GPU that no other process on this machine holds, once, before CUDA starts.

    Each visible GPU (``nvidia-smi``, within ``CUDA_VISIBLE_DEVICES``) has a lock named by its UUID in the temporary
    directory; the process holds the first it gets for its lifetime (the OS drops it when the process dies) and
    sees only that GPU (``CUDA_VISIBLE_DEVICES=<uuid>``), so the cell's ``devices=1`` is its own device.
    """
    global _GPU_LOCK
    if _GPU_LOCK is not None:
        return
    from filelock import FileLock, Timeout

    listed = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                            text=True, check=True).stdout
    gpus = [line.split(", ") for line in listed.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        allowed = set(visible.split(","))
        gpus = [(i, uuid) for i, uuid in gpus if i in allowed or uuid in allowed]
    for _, uuid in gpus:
        lock = FileLock(os.path.join(tempfile.gettempdir(), f"lightning-mrs-{uuid}.lock"), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            continue
        _GPU_LOCK = lock
        os.environ["CUDA_VISIBLE_DEVICES"] = uuid
        return
    raise RuntimeError(f"{socket.gethostname()}: all {len(gpus)} GPUs are held by other worker processes: start one "
                       "worker process per GPU (--resources GPU=1 each)")
