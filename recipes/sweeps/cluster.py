"""Where a sweep's cells run: a ``dask.distributed`` client on this machine's LocalCluster, a scheduler or SLURM jobs.

:func:`connect` opens the client and checks, before any cell runs, what can be known then: the scheduler answers, its
workers import this project, a GPU sweep has workers offering a ``GPU`` resource, a ``--slurm-option`` is an argument
of dask-jobqueue's ``SLURMCluster``. A GPU cell asks for ``resources={"GPU": 1}``; its worker process then takes a
GPU of its own (:func:`pin_gpu`), so a machine's worker processes, one per GPU, each run on their own device.
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
from typing import Any, Optional

from recipes.common.errors import UsageError

__all__ = ["Cluster", "connect", "pin_gpu", "slurm_kwargs"]

ROOT = Path(__file__).resolve().parents[2]  # the repository root: workers import recipes from there
_DAEMON = "DASK_DISTRIBUTED__WORKER__DAEMON=False"  # a cell's DataLoader workers are children of its worker process
_GPU_LOCK: Any = None  # the lock on this worker process's own GPU, held while the process lives


def _need(module: str, flag: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f'{flag} needs {module} (the [cluster] extra): pip install -e ".[cluster]"') from None


def _gpu(args: argparse.Namespace) -> bool:
    return args.accelerator in ("gpu", "cuda")


@dataclass
class Cluster:
    """The client, a one-line description, torch's threads per cell (``None``: the worker's own), whether cells ask
    for a GPU, and what was started besides the client."""

    client: Any
    where: str
    threads: Optional[int]
    gpu: bool
    started: Any = None

    def close(self) -> None:
        self.client.close()
        if self.started is not None:
            self.started.close()


def connect(args: argparse.Namespace, jobs: int, cpus: int) -> Cluster:
    """The cluster of ``--scheduler``, ``--slurm`` or else a LocalCluster of ``jobs`` worker processes."""
    flag = "--scheduler" if args.scheduler else "--slurm" if args.slurm else f"--jobs {jobs}"
    distributed = _need("distributed", flag)
    if args.scheduler:
        return _join(args, distributed)
    if args.slurm:
        cluster = _slurm(args)
        return Cluster(distributed.Client(cluster), f"{args.slurm_jobs} SLURM job(s) from {cluster.scheduler_address}",
                       max(1, args.slurm_cpus // max(1, args.slurm_gpus)), args.slurm_gpus > 0, cluster)
    gpus = 0
    if args.accelerator in ("gpu", "cuda", "auto"):
        import torch

        gpus = torch.cuda.device_count()
    if _gpu(args) and jobs > gpus:
        raise UsageError(f"--jobs {jobs}: a GPU cell needs a GPU of its own and this machine has {gpus}: "
                         f"--jobs {gpus} at most")
    with _need("dask", flag).config.set({"distributed.worker.daemon": False}):
        cluster = distributed.LocalCluster(
            n_workers=jobs, threads_per_worker=1, processes=True, host="127.0.0.1", silence_logs=logging.ERROR,
            dashboard_address="127.0.0.1:0", worker_dashboard_address="127.0.0.1:0",  # HTTP routes: loopback only
            resources={"GPU": 1} if gpus else None)
    return Cluster(distributed.Client(cluster), f"{jobs} local worker processes", max(1, cpus // jobs), gpus > 0,
                   cluster)


def _join(args: argparse.Namespace, distributed: Any) -> Cluster:
    """A client of the running ``--scheduler``, whose workers can run the cells."""
    from dask import config, utils

    flag = f"--scheduler {args.scheduler}"
    timeout = utils.parse_timedelta(config.get("distributed.comm.timeouts.connect"), "s")
    try:
        client = distributed.Client(args.scheduler, timeout=timeout)
    except (OSError, TimeoutError, ValueError) as err:
        raise UsageError(f"{flag}: no Dask scheduler answered in {timeout:g} s (Dask's distributed.comm.timeouts."
                         f"connect; {str(err).splitlines()[0] if str(err) else type(err).__name__}): start one (dask "
                         "scheduler) or fix the address") from None
    try:
        offered = _check_workers(args, client, flag, timeout)
    except BaseException:
        client.close()
        raise
    return Cluster(client, f"the Dask scheduler at {args.scheduler}", None, _gpu(args) or args.accelerator == "auto"
                   and offered)


def _check_workers(args: argparse.Namespace, client: Any, flag: str, timeout: float) -> bool:
    """Each worker imports the project and may start the cells' DataLoader workers; whether one offers a GPU."""
    try:
        client.wait_for_workers(1, timeout=timeout)
    except TimeoutError:
        raise UsageError(f"{flag}: no worker joined in {timeout:g} s: start workers (dask worker {args.scheduler} "
                         "--nthreads 1, from the repository root)") from None
    loaders = args.num_workers or args.num_workers is None and args.accelerator != "cpu"  # DataLoader worker processes
    for address, daemonic in client.run(_probe, on_error="return").items():
        if isinstance(daemonic, BaseException):
            raise UsageError(f"{flag}: worker {address} cannot import this project ({type(daemonic).__name__}: "
                             f"{daemonic}): install it there (pip install -e \".[recipes,cluster]\") or start the "
                             "worker from the repository root with python -m distributed.cli.dask_worker")
        if daemonic and loaders:
            raise UsageError(f"--num-workers {args.num_workers or 'default (up to 8 off the CPU)'}: worker {address} "
                             f"is a daemonic process, which may not start DataLoader workers: start workers with "
                             f"{_DAEMON} or use --num-workers 0")
    offered = any(w.get("resources", {}).get("GPU") for w in client.scheduler_info()["workers"].values())
    if _gpu(args) and not offered:
        raise UsageError(f"--accelerator {args.accelerator}: no worker of {flag} offers a GPU resource: start GPU "
                         "workers with --resources GPU=1 (one worker process per GPU), or use --accelerator cpu")
    return offered


def _probe() -> bool:
    """On a worker (it unpickles only where the project imports): whether its process is daemonic."""
    import multiprocessing

    return multiprocessing.current_process().daemon


def slurm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """dask-jobqueue ``SLURMCluster`` arguments of the ``--slurm-*`` options: one worker process per GPU of a
    job (one thread each, ``GPU=1``), or one per CPU-only job; ``--slurm-option KEY=VALUE`` passed on as is."""
    processes = max(1, args.slurm_gpus)
    kwargs: dict[str, Any] = dict(
        queue=args.slurm_partition, cores=processes, processes=processes, job_cpu=args.slurm_cpus,
        memory="16GB", walltime=args.slurm_time, python=sys.executable,
        job_script_prologue=[f"cd {ROOT}", f"export {_DAEMON}"],  # python -m imports recipes from there
        job_extra_directives=[f"--gres=gpu:{args.slurm_gpus}"] if args.slurm_gpus else [],
        worker_extra_args=["--resources", "GPU=1"] if args.slurm_gpus else [])
    for key, _, text in (item.partition("=") for item in args.slurm_option):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text  # a plain string: account=proj
        kwargs[key] = kwargs[key] + value if isinstance(kwargs.get(key), list) and isinstance(value, list) else value
    return kwargs


def _slurm(args: argparse.Namespace) -> Any:
    jobqueue = _need("dask_jobqueue", "--slurm")
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
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    gpus = [uuid for index, uuid in (line.split(", ") for line in listed.splitlines() if line.strip())
            if visible == [""] or index in visible or uuid in visible]
    for uuid in gpus:
        lock = FileLock(os.path.join(tempfile.gettempdir(), f"lightning-mrs-{uuid}.lock"), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            continue
        _GPU_LOCK, os.environ["CUDA_VISIBLE_DEVICES"] = lock, uuid
        return
    raise RuntimeError(f"{socket.gethostname()}: all {len(gpus)} GPUs are held by other worker processes: start one "
                       "worker process per GPU (--resources GPU=1 each)")
