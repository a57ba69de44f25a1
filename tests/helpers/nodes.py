"""Two "nodes" on this host: a recipe's multi-node job started as a cluster starts it, on the loopback.

Each node is one command with its own environment, as each machine of a cluster runs it:

* ``torchrun``: ``python -m torch.distributed.run --nnodes 2 --node_rank R --nproc_per_node 1
  --master_addr 127.0.0.1 --master_port P script ...`` (Lightning reads torchrun's variables);
* ``lightning``: ``python script ...`` with Lightning's own variables ``MASTER_ADDR``, ``MASTER_PORT``,
  ``NODE_RANK`` and ``WORLD_SIZE`` (its on-prem cluster guide);
* ``slurm``: ``python script ...`` with the variables ``srun --nodes 2 --ntasks-per-node 1`` gives each
  task (``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_NODEID``, ``SLURM_NODELIST``, ``SLURM_JOB_ID`` ...),
  which Lightning's ``SLURMEnvironment`` reads.

Every process binds 127.0.0.1 only; each node runs in its own session, so a failure or a timeout kills
the node's whole process group (torchrun's workers too) and nothing is left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from helpers.ddp import free_port

__all__ = ["LAUNCHERS", "LAUNCH_VARIABLES", "NodeResult", "node_commands", "run_nodes", "single_node"]

LAUNCHERS = ("torchrun", "lightning", "slurm")

#: variables a launcher sets (and SLURM_*): cleared from the test's own environment, only the node's count
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                     "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED")

#: the job id of the simulated SLURM job (the run's version directory: ``version_<job id>``)
SLURM_JOB_ID = 424242


@dataclass
class NodeResult:
    """What one node's command did: its exit status and its output (stdout and stderr together)."""

    returncode: int
    output: str


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def node_commands(launcher: str, script: Path, args: list[str], nodes: int = 2) -> list[tuple[list[str], dict[str, str]]]:
    """Each node's command and environment for ``launcher`` (one process per node, a fresh port)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: choose one of {list(LAUNCHERS)}")
    port = str(free_port())
    commands = []
    for node in range(nodes):
        env = _base_env()
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node),
                   "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, str(script), *args]
        elif launcher == "lightning":
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node), WORLD_SIZE=str(nodes))
            cmd = [sys.executable, str(script), *args]
        else:  # what srun sets in task `node` of `--nodes N --ntasks-per-node 1`; the port as a user pins it
            env.update(SLURM_NTASKS=str(nodes), SLURM_NTASKS_PER_NODE="1", SLURM_NNODES=str(nodes),
                       SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NODEID=str(node),
                       SLURM_NODELIST="127.0.0.1", SLURM_JOB_ID=str(SLURM_JOB_ID), SLURM_JOB_NAME="multinode-test",
                       MASTER_PORT=port)
            cmd = [sys.executable, str(script), *args]
        commands.append((cmd, env))
    return commands


def _stop(proc: subprocess.Popen) -> None:
    """End the node's process group (the process and what it started), politely and then not."""
    if proc.poll() is not None:
        return
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_nodes(commands: list[tuple[list[str], dict[str, str]]], cwd: Path, timeout: float = 300) -> list[NodeResult]:
    """Start every node's command at once (each in its own session, output to a file under ``cwd``) and wait
    for all; a node that fails makes the others stop after a short grace (they would wait for it), a
    timeout stops all. Returns each node's exit status and output."""
    procs, logs = [], []
    try:
        for i, (cmd, env) in enumerate(commands):
            log = open(cwd / f"node{i}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 30:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            _stop(p)
    results = []
    for p, log in zip(procs, logs):
        log.seek(0)
        results.append(NodeResult(p.returncode, log.read()))
        log.close()
    return results


def single_node(script: Path, args: list[str], cwd: Path, timeout: float = 300) -> NodeResult:
    """``python script args`` on one node: Lightning starts the other processes of ``--trainer.devices``."""
    env = _base_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    (result,) = run_nodes([([sys.executable, str(script), *args], env)], cwd, timeout)
    return result
