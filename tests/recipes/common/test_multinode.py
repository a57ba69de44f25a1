"""Multi-node training of both recipes: two "nodes" on this host (gloo on the loopback), one process each,
started as torchrun, Lightning's own variables and SLURM's ``srun`` start them, end with the weights of a
one-node, two-process run of the same command (same global batch): bit for bit.

Why bit for bit and not close: both jobs are the same two ranks with the same data (each rank's share of
the global batch is a function of the seed and the global rank alone), and DDP's gradient all-reduce over
two ranks adds two numbers, whichever rank's comes first (``a + b == b + a`` in IEEE arithmetic); gloo's
algorithm depends on the world size and the ranks, not on how the ranks are grouped into nodes.

Each run also writes the same files as the one-node run (one version directory, one ``last.ckpt``, one
export): the two "nodes" share the root folder, as nodes on a shared file system do, and a second node
writing its own copy, a clash of names or a file outside the root would show here.

``--trainer.num_nodes 2`` in a command that no launcher started waits for the other node forever (Ctrl-C
too): it is one error line instead.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from helpers import ROOT
from helpers.lm import TINY_CONFIG
from helpers.nodes import LAUNCH_VARIABLES, LAUNCHERS, SLURM_JOB_ID, node_commands, run_nodes, single_node
from recipes.common.errors import UsageError
from recipes.common.training import check_nodes

TIMEOUT = 300  # seconds, per job (all its nodes)

ARGS = {
    "cifar100": ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--model.arch", "timm:test_resnet",
                 "--model.norm", "mrs", "--data.dataset", "digits", "--data.image_size", "8", "--data.batch_size", "8",
                 "--trainer.max_steps", "3", "--trainer.limit_val_batches", "2",
                 "--trainer.enable_progress_bar", "false"],
    "lm": ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--model.config", json.dumps(TINY_CONFIG),
           "--model.norm", "mrs", "--data.seq_len", "32", "--data.batch_size", "4", "--data.val_windows", "8",
           "--trainer.max_steps", "3", "--trainer.val_check_interval", "2", "--model.sample_bytes", "8",
           "--trainer.enable_progress_bar", "false"],
}
GLOBAL_BATCH = {"cifar100": "global batch 16 = 8 per device x 2 processes",
                "lm": "global batch 8 windows of 32 bytes = 4 per device x 2 processes"}


def _script(recipe: str) -> Path:
    return ROOT / "recipes" / f"{recipe}.py"


def _files(run: Path) -> list[str]:
    """The files of a run folder, relative, TensorBoard's event files without their host.pid.counter."""
    names = (str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    return sorted(re.sub(r"events\.out\.tfevents\.[^/]*?(\.hparams)?$", r"events.out.tfevents.*\1", n) for n in names)


def _only_version(cwd: Path) -> Path:
    """The run folder (``<cwd>/run/lightning_logs/version_*``): there must be exactly one."""
    versions = list((cwd / "run" / "lightning_logs").iterdir())
    assert len(versions) == 1, versions
    return versions[0]


def _assert_equal(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` are the same nested dicts/lists of tensors and numbers, tensors equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The one-node, two-process run of a recipe (Lightning starts rank 1): its run folder, made once."""
    runs: dict[str, Path] = {}

    def get(recipe: str) -> Path:
        if recipe not in runs:
            cwd = tmp_path_factory.mktemp(f"one_node_{recipe}")
            result = single_node(_script(recipe), [*ARGS[recipe], "--trainer.num_nodes", "1", "--trainer.devices", "2",
                                                   "--trainer.default_root_dir", "run"], cwd, TIMEOUT)
            assert result.returncode == 0, result.output[-4000:]
            assert GLOBAL_BATCH[recipe] in result.output
            runs[recipe] = _only_version(cwd)
        return runs[recipe]

    return get


@pytest.mark.slow  # each job is two processes of ~8 s of imports and start-up (30-140 s a case on 2 busy cores)
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("recipe", ["cifar100", "lm"])
def test_two_nodes_end_with_the_one_node_weights(recipe: str, launcher: str, tmp_path: Path,
                                                 one_node: Callable[[str], Path]) -> None:
    args = [*ARGS[recipe], "--trainer.num_nodes", "2", "--trainer.devices", "1", "--trainer.default_root_dir", "run"]
    results = run_nodes(node_commands(launcher, _script(recipe), args), tmp_path, TIMEOUT)
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}:\n{result.output[-4000:]}"
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in results[0].output and "GLOBAL_RANK: 1, MEMBER: 2/2" in results[1].output
    assert GLOBAL_BATCH[recipe] in results[0].output
    assert "distributed_backend=gloo" in results[0].output

    run, reference = _only_version(tmp_path), one_node(recipe)
    # under SLURM the run is named by the job (RunLogger's version), elsewhere version_0 as on one node
    assert run.name == (f"version_{SLURM_JOB_ID}" if launcher == "slurm" else "version_0")
    assert _files(run) == _files(reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node0.log", "node1.log", "run"]  # nothing elsewhere

    two = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    one = torch.load(reference / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert two["global_step"] == one["global_step"] == 3
    _assert_equal(two["state_dict"], one["state_dict"], "state_dict")
    _assert_equal(two["optimizer_states"], one["optimizer_states"], "optimizer_states")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a plain command: none of the variables a launcher sets."""
    for name in [*LAUNCH_VARIABLES, *(k for k in os.environ if k.startswith(("SLURM_", "LSB_", "OMPI_", "PMI_")))]:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("recipe", ["cifar100", "lm"])
def test_more_nodes_in_a_plain_command_is_one_line(recipe: str, no_launcher: None, monkeypatch: pytest.MonkeyPatch,
                                                   recipe_error: Callable[[list[str]], str],
                                                   lm_error: Callable[[list[str]], str]) -> None:
    from recipes.cifar100 import build_cli as cifar_cli
    from recipes.lm import build_cli as lm_cli

    monkeypatch.setattr(sys, "argv", [f"{recipe}.py"])
    args = [*ARGS[recipe], "--trainer.num_nodes", "2", "--trainer.devices", "1"]
    with pytest.raises(UsageError):  # before any fit: Lightning would wait for node 1 at the first step
        (cifar_cli if recipe == "cifar100" else lm_cli)(args)
    line = (recipe_error if recipe == "cifar100" else lm_error)(args)
    assert line.startswith("error: --trainer.num_nodes 2: nothing started this process as one of 2 nodes, so it "
                           "would wait for the others forever; run the command on each node under torchrun "
                           "(--nnodes 2 --node_rank R --master_addr HOST ...), srun (SLURM), or with MASTER_ADDR, "
                           "MASTER_PORT and NODE_RANK set"), line


@pytest.mark.parametrize("launched_by", ["torchrun", "lightning", "slurm"])
def test_more_nodes_under_a_launcher_pass_the_check(launched_by: str, no_launcher: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (cmd, env), _ = node_commands(launched_by, Path("train.py"), [])
    if launched_by == "torchrun":  # what torchrun sets in its worker (the command above is torchrun itself)
        env.update(RANK="0", GROUP_RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none")
    for name, value in env.items():
        if name not in os.environ or os.environ[name] != value:
            monkeypatch.setenv(name, value)
    check_nodes(2)
    for name in [*LAUNCH_VARIABLES, *(k for k in os.environ if k.startswith("SLURM_"))]:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="--trainer.num_nodes 2: nothing started"):
        check_nodes(2)
    check_nodes(1)
    check_nodes(2, plugins=["my.ClusterEnvironment"])  # the user's own environment: Lightning decides
