"""FSDP2 with float16 and a loss scaler: every process skips the same steps (``--trainer.strategy fsdp2
--trainer.precision 16-mixed``).

Under ``fully_shard`` each process holds a shard of every gradient, so an Inf in one process's shard is
invisible to the others unless the scaler's check is reduced over the shards; otherwise one process
skips the step and halves its scale while the others step, and the shards of one model drift apart.
torch's ``GradScaler`` reduces it there (DTensor's ``found_inf`` handler); the job below checks it on 2
gloo processes with an Inf planted in one process's shard only, and the recipe's run in that setting.

Run as a script, this module is the job: ``python test_lm_fsdp2.py OUT`` on 2 processes (torchrun-like
environment set by :func:`helpers.ddp.run_job` through ``torch.multiprocessing``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT
from helpers.ddp import run_job
from helpers.lm import OWN_NORMS, TINY
from helpers.scripts import run_script


def _rank(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    record = []
    for step in range(2):
        before = [p.to_local().clone() for p in model.parameters()]
        with torch.autocast("cpu", torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if step == 0 and rank == 1:  # an overflow in this process's shard only
            next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        changed = any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
        record.append({"scale": float(scaler.get_scale()), "stepped": changed})
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _job(out: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(2, out), nprocs=2, join=True)


if __name__ == "__main__":
    _job(sys.argv[1])
    sys.exit(0)


def test_the_scaler_skips_the_same_steps_on_every_fsdp2_shard(tmp_path: Path) -> None:
    proc = run_job(Path(__file__), str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # step 0: the Inf of rank 1's shard makes both processes skip and halve the scale; step 1: both step
    for record in ranks:
        assert record == [{"scale": 32768.0, "stepped": False}, {"scale": 32768.0, "stepped": True}], ranks


def _fsdp2_run(tmp_path: Path, precision: str) -> str:
    proc = run_script(ROOT / "recipes" / "lm.py", [*TINY, *OWN_NORMS, "--trainer.devices", "2", "--trainer.strategy",
                                                   "fsdp2", "--trainer.precision", precision,
                                                   "--trainer.default_root_dir", str(tmp_path)], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "global batch 8 windows of 32 bytes = 4 per device x 2 processes" in out
    assert "FSDP2: fully_shard on 2 decoder layers (LlamaDecoderLayer) and the whole model, over 2 processes" in out
    assert "fit: 3 steps in" in out
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_dir()  # a sharded checkpoint
    return out


def test_fsdp2_in_float16_with_its_scaler_on_two_cpu_processes(tmp_path: Path) -> None:
    out = _fsdp2_run(tmp_path, "16-mixed")
    assert "precision 16-mixed: activations ran in torch.float16 (MixedPrecision, loss scaler GradScaler on cpu)" in out


@pytest.mark.slow
def test_fsdp2_in_float32_on_two_cpu_processes(tmp_path: Path) -> None:
    out = _fsdp2_run(tmp_path, "32-true")
    assert "precision 32-true: activations ran in torch.float32" in out
