"""The sweep's cells as tasks of a Dask cluster: a real scheduler and workers, each its own process, on 127.0.0.1 only.

A tiny digits sweep through ``--scheduler``: every cell runs once, on both workers (each record names its worker),
and ``results.csv`` equals the same sweep on this machine's own cluster (``--jobs 2``); a worker killed mid-sweep
loses nothing (the cells it held run on the other, the finished ones are kept as written). SLURM: the job script
``SLURMCluster`` writes for the documented options. The mistakes (a scheduler that does not answer, a worker without
the project, a ``--slurm-option`` Dask does not know, a GPU cell without GPU workers, the missing extra) are one
line naming the option, before any cell runs, and write nothing.
"""

from __future__ import annotations

import csv
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from helpers import ROOT
from helpers.scripts import run_script
from recipes.stress import parse_args, run
from recipes.sweeps.cli import usable_cpus
from recipes.sweeps.cluster import slurm_kwargs

dask = pytest.importorskip("dask")
distributed = pytest.importorskip("distributed")

SCRIPT = ROOT / "recipes" / "stress.py"
# 6 cells: 3 learning rates x 2 norms, 3 optimizer steps each
GRID = ["--dataset", "digits", "--norms", "layer", "mrs", "--lrs", "0.1", "0.3", "0.4", "--batch-sizes", "16",
        "--seeds", "0", "--max-steps", "3", "--log-every", "1", "--mrs-backend", "eager"]
TINY = ["--dataset", "digits", "--norms", "mrs", "--lrs", "0.1", "--batch-sizes", "16", "--seeds", "0", "--max-steps",
        "1", "--mrs-backend", "eager"]
_UNTIL_S = 300  # the longest any wait below waits (a worker imports torch and Lightning on 2 busy cores)


class Processes:
    """Scheduler and worker processes started by a test, all killed at its end however it ends."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, {}

    def scheduler(self) -> str:
        """A scheduler on 127.0.0.1, its HTTP routes too (no dashboard, gone after 10 idle minutes); its address.
        Started as docs/recipes.md says (``dask scheduler``), outside the repository and without it on the path:
        a scheduler does not import this project."""
        file = self.tmp / "scheduler.json"
        self._start("scheduler", ["dask", "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                  "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(file),
                                  "--idle-timeout", "600"], self.tmp)
        _until(lambda: file.exists() and "address" in file.read_text(), "the scheduler's address file")
        return json.loads(file.read_text())["address"]

    def worker(self, address: str, name: str, cwd: Path = ROOT) -> None:
        """A worker on 127.0.0.1 (its HTTP routes too), one thread, no nanny (killing it kills it), started from ``cwd``
        (``python -m`` puts ``cwd`` on its path: the repository root, where it imports ``recipes``)."""
        self._start(name, ["distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--nthreads", "1",
                           "--no-nanny", "--no-dashboard", "--dashboard-address", "127.0.0.1:0", "--name", name,
                           "--death-timeout", "60"], cwd)

    def _start(self, name: str, argv: list[str], cwd: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // 2))  # the threads of a cell of --jobs 2 on this machine
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", *argv], cwd=cwd, env=env, stdout=log,
                                            stderr=subprocess.STDOUT)

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait(timeout=60)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=60)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.close()


def _until(done: Callable[[], bool], what: str, seconds: float = _UNTIL_S) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {seconds} s for {what}")
        time.sleep(0.2)


def _workers(client: object) -> dict[str, str]:
    """The cluster's workers: name -> address."""
    return {w["name"]: address for address, w in client.scheduler_info()["workers"].items()}  # type: ignore[attr-defined]


def _records(out: Path) -> dict[str, bytes]:
    return {p.stem: p.read_bytes() for p in sorted((out / "cells").glob("*.json"))}


def _results(out: Path) -> list[dict[str, str]]:
    """``results.csv``'s rows without the cost columns (the only ones that differ between two runs)."""
    with open(out / "results.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k not in ("wall_s", "cpu_s")} for row in csv.DictReader(f)]


@pytest.mark.slow  # a scheduler, two workers importing torch and Lightning, 18 cells: ~2-5 min on 2 busy cores
def test_a_sweep_on_two_workers_equals_the_local_one_and_survives_a_killed_worker(
        tmp_path: Path, processes: Processes) -> None:
    address = processes.scheduler()
    assert address.startswith("tcp://127.0.0.1:")
    processes.worker(address, "w0")
    processes.worker(address, "w1")
    client = distributed.Client(address, timeout=60)
    try:
        client.wait_for_workers(2, timeout=_UNTIL_S)
        workers = _workers(client)
        local = tmp_path / "local"
        proc = run_script(SCRIPT, [*GRID, "--jobs", "2", "--out", str(local)], timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]

        remote = tmp_path / "remote"
        proc = run_script(SCRIPT, [*GRID, "--scheduler", address, "--out", str(remote)], timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"6 to run (the Dask scheduler at {address})" in proc.stdout
        records = {name: json.loads(text) for name, text in _records(remote).items()}
        assert len(records) == 6
        assert {r["worker"] for r in records.values()} == set(workers.values())  # cells landed on both workers
        for name in records:  # every cell ran once: one TensorBoard run, one progress line
            runs = [p for p in (remote / "tb" / name).glob("events.out.tfevents.*") if p.suffix != ".hparams"]
            assert len(runs) == 1, runs
        assert sorted(re.findall(r"\[\d/6\] (\S+):", proc.stdout)) == sorted(records)
        assert _results(remote) == _results(local)  # cell by cell, the machine and threads included

        # a worker killed while it holds cells: they run on the other worker; what was written stays as it was
        killed = tmp_path / "killed"
        driver = subprocess.Popen([sys.executable, str(SCRIPT), *GRID, "--scheduler", address, "--out", str(killed)],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            def w1_finished_one_and_holds_another() -> bool:
                mine = [json.loads(t)["worker"] == workers["w1"] for t in _records(killed).values()]
                return driver.poll() is not None or (any(mine) and bool(client.processing(workers["w1"])))

            _until(w1_finished_one_and_holds_another, "w1 to finish a cell and hold another")
            held = {key.split("@")[0] for keys in client.processing(workers["w1"]).values() for key in keys}
            before = _records(killed)
            processes.kill("w1")
            stdout, stderr = driver.communicate(timeout=900)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait(timeout=60)
        assert driver.returncode == 0, stderr[-3000:]
        assert held and len(before) < 6  # mid-sweep
        after = _records(killed)
        assert {name: after[name] for name in before} == before  # the finished cells are kept as written
        assert len(after) == 6
        assert all(json.loads(after[name])["worker"] == workers["w0"] for name in held)  # rerun on the other
        assert _results(killed) == _results(local)
    finally:
        client.close()


@pytest.mark.slow  # a scheduler, a worker importing torch and Lightning, a LocalCluster: ~1 min on 2 busy cores
def test_a_scheduler_started_as_documented_outside_the_repository_runs_the_sweep_as_jobs_does(
        tmp_path: Path, processes: Processes, capsys: pytest.CaptureFixture) -> None:
    """``dask scheduler`` from a folder without the project (issue 61, case 6): before, the scheduler failed to
    unpickle the cells' tasks (``ModuleNotFoundError: No module named 'recipes'``) and the sweep ended in that
    traceback; only a scheduler started from the repository root worked, which is how these tests started it."""
    address = processes.scheduler()
    processes.worker(address, "w0")
    local, remote = tmp_path / "local", tmp_path / "remote"
    two = [*TINY, "--norms", "layer", "mrs"]  # 2 cells: --jobs 2 runs them with 1 thread each, as the worker does
    assert run([*two, "--jobs", "2", "--out", str(local)]) == 0
    assert run([*two, "--scheduler", address, "--out", str(remote)]) == 0, capsys.readouterr().err[-3000:]
    assert f"2 to run (the Dask scheduler at {address})" in capsys.readouterr().out
    records = [json.loads(text) for text in _records(remote).values()]
    assert len(records) == 2 and all(r["worker"].startswith("tcp://127.0.0.1:") for r in records)
    assert _results(remote) == _results(local)  # cell by cell, the machine and threads included


@pytest.mark.slow  # a scheduler and two light workers: ~10-20 s on 2 busy cores
def test_a_gpu_cell_without_gpu_workers_and_a_worker_without_the_project_are_refused(
        tmp_path: Path, processes: Processes, capsys: pytest.CaptureFixture, error_line: Callable[[int, str], str]
) -> None:
    address = processes.scheduler()
    processes.worker(address, "w0")
    out = tmp_path / "sweep"
    status = run([*TINY, "--scheduler", address, "--accelerator", "gpu", "--out", str(out)])
    line = error_line(status, capsys.readouterr().err)
    assert f"--accelerator gpu: no worker of --scheduler {address} offers a GPU resource" in line
    assert "--resources GPU=1" in line
    processes.worker(address, "elsewhere", cwd=tmp_path)  # started outside the repository: no recipes to import
    client = distributed.Client(address, timeout=60)
    try:
        client.wait_for_workers(2, timeout=_UNTIL_S)
        elsewhere = _workers(client)["elsewhere"]
    finally:
        client.close()
    status = run([*TINY, "--scheduler", address, "--out", str(out)])
    line = error_line(status, capsys.readouterr().err)
    assert f"--scheduler {address}: worker {elsewhere} cannot import this project" in line
    assert "No module named 'recipes'" in line
    assert not out.exists()  # nothing written: the corrected command starts afresh


def test_a_scheduler_that_does_not_answer_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      error_line: Callable[[int, str], str]) -> None:
    with socket.socket() as s:  # a port on which nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "sweep"
    with dask.config.set({"distributed.comm.timeouts.connect": "2s"}):  # Dask's own setting: 30 s by default
        status = run([*TINY, "--scheduler", f"tcp://127.0.0.1:{port}", "--out", str(out)])
    line = error_line(status, capsys.readouterr().err)
    assert f"--scheduler tcp://127.0.0.1:{port}: no Dask scheduler answered in 2 s" in line
    assert not out.exists()


def test_an_option_slurmcluster_does_not_know_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                          error_line: Callable[[int, str], str]) -> None:
    pytest.importorskip("dask_jobqueue")
    out = tmp_path / "sweep"
    status = run([*TINY, "--slurm", "--slurm-option", "colour=blue", "--out", str(out)])
    line = error_line(status, capsys.readouterr().err)
    assert "--slurm-option colour=...: not an argument of dask-jobqueue's SLURMCluster" in line
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--slurm-gpus", "2"], "--slurm-gpus is an option of --slurm: add --slurm"),
    (["--slurm", "--scheduler", "tcp://127.0.0.1:1"], "argument --scheduler: not allowed with argument --slurm"),
    (["--scheduler", "tcp://127.0.0.1:1", "--jobs", "2"], "--jobs sets this machine's worker processes"),
    (["--slurm", "--slurm-option", "account"], "--slurm-option 'account': give KEY=VALUE"),
    (["--slurm", "--accelerator", "gpu"], "--accelerator gpu with --slurm needs GPUs in the jobs: give --slurm-gpus"),
])
def test_cluster_options_that_do_not_fit(argv: list[str], message: str, capsys: pytest.CaptureFixture,
                                         error_line: Callable[[int, str], str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*TINY, *argv])
    assert message in error_line(exit_.value.code, capsys.readouterr().err)


def test_without_the_extra_slurm_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture,
                                                       error_line: Callable[[int, str], str]) -> None:
    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)  # as in an environment without it: import fails
    status = run([*TINY, "--slurm", "--out", str(tmp_path / "sweep")])
    line = error_line(status, capsys.readouterr().err)
    assert "--slurm needs dask_jobqueue (the [cluster] extra): pip install -e \".[cluster]\"" in line


def test_the_slurm_job_script_of_the_documented_options() -> None:
    jobqueue = pytest.importorskip("dask_jobqueue")
    from dask_jobqueue.slurm import slurm_format_bytes_ceil
    from dask.utils import parse_bytes

    args = parse_args([*TINY, "--slurm", "--slurm-partition", "gpu", "--slurm-gpus", "4", "--slurm-cpus", "32",
                       "--slurm-option", "memory=64GB", "--slurm-time", "04:00:00", "--slurm-jobs", "2",
                       "--slurm-option", "account=proj", "--slurm-option", 'job_extra_directives=["--qos=high"]'])
    assert args.slurm_jobs == 2
    # the scheduler SLURMCluster starts: on loopback in a test (a real run listens where the jobs can reach it)
    loopback = {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"}
    cluster = jobqueue.SLURMCluster(**slurm_kwargs(args), scheduler_options=loopback)
    try:
        script = cluster.job_script()
        address = cluster.scheduler_address
    finally:
        cluster.close()
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for expected in ("-p gpu", "--cpus-per-task=32", f"--mem={slurm_format_bytes_ceil(parse_bytes('64GB'))}",
                     "-t 04:00:00", "-A proj", "--gres=gpu:4", "--qos=high"):
        assert f"#SBATCH {expected}" in directives, (expected, directives)
    assert f"cd {ROOT}" in script and "export DASK_DISTRIBUTED__WORKER__DAEMON=False" in script
    command = script.strip().splitlines()[-1]
    assert command.startswith(f"{sys.executable} -m distributed.cli.dask_worker {address} ")
    flags = dict(re.findall(r"--(nthreads|nworkers|resources) (\S+)", command))
    assert flags == {"nthreads": "1", "nworkers": "4", "resources": "GPU=1"}  # a worker process per GPU

    cpu = parse_args([*TINY, "--slurm", "--slurm-cpus", "8"])  # no GPUs: one worker process with 8 CPUs
    kwargs = slurm_kwargs(cpu)
    assert (kwargs["processes"], kwargs["cores"], kwargs["job_cpu"], kwargs["job_extra_directives"]) == (1, 1, 8, [])
