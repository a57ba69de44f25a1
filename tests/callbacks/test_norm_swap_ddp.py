"""NormSwap under Lightning's multi-process launchers: 2 gloo processes on the CPU.

``strategy="ddp"`` (a script process per device) trains with the swapped layers in DDP's
gradient sync, checkpoints, and the checkpoint restores in the test process. The
multiprocessing launcher (``ddp_spawn``, ``ddp_fork``; ``ddp_notebook`` is ``ddp_fork``) is
refused in the workers' setup, before training: the main process gets torch's
``ProcessRaisedException`` holding NormSwap's message.

Run as a script (``python tests/callbacks/test_norm_swap_ddp.py STRATEGY OUT_DIR``) this file
is the job: Lightning's ``ddp`` launcher re-runs the same command line for rank 1, the
multiprocessing launcher starts its workers from it. Each test runs one job in a subprocess.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers.ddp import run_job
from helpers.lightning import TinyModule, fit, image_data
from lightning_mrs import MRSNorm, MRSNorm2d, swap_norms
from lightning_mrs.callbacks import NormSwap

STEPS = 3
X = image_data(4, seed=7).tensors[0]  # (4, 3, 7, 5)


def _job(strategy: str, out: Path) -> None:
    try:
        trainer, module = fit(TinyModule(), steps=STEPS, callbacks=[NormSwap()], strategy=strategy, devices=2)
    except Exception as err:  # the main process of a refused launch
        (out / "error.json").write_text(json.dumps({"type": type(err).__name__, "message": str(err)}))
        return
    trainer.save_checkpoint(out / "last.ckpt")  # every rank calls it; rank 0 writes
    with torch.no_grad():
        torch.save({"state": module.state_dict(), "y": module.eval()(X)}, out / f"rank{trainer.global_rank}.pt")


def test_ddp_trains_the_swapped_layers_in_sync_and_the_checkpoint_restores(tmp_path):
    proc = run_job(Path(__file__), "ddp", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # each rank saw other samples: equal weights mean DDP synced the new layers' gradients
    assert list(rank0["state"]) == list(rank1["state"])
    for key, value in rank0["state"].items():
        assert torch.equal(value, rank1["state"][key]), key
    inherited = TinyModule()
    swap_norms(inherited)
    assert not torch.equal(rank0["state"]["net.1.weight"], inherited.state_dict()["net.1.weight"])  # trained

    restored = NormSwap.restore(TinyModule(), tmp_path / "last.ckpt").eval()
    assert isinstance(restored.net[1], MRSNorm2d) and isinstance(restored.net[5], MRSNorm)
    for key, value in rank0["state"].items():
        assert torch.equal(restored.state_dict()[key], value), key
    with torch.no_grad():
        torch.testing.assert_close(restored(X), rank0["y"], atol=0, rtol=0)


@pytest.mark.parametrize("strategy", ["ddp_fork", pytest.param("ddp_spawn", marks=pytest.mark.slow)])
def test_multiprocessing_launchers_are_refused_before_training(tmp_path, strategy):
    # before the refusal, training finished and then the main process's unswapped model failed to load the weights
    proc = run_job(Path(__file__), strategy, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = json.loads((tmp_path / "error.json").read_text())
    assert error["type"] == "ProcessRaisedException"  # torch's wrapper of a worker's exception
    message = error["message"]
    assert "MisconfigurationException: NormSwap does not support strategy='ddp_spawn', 'ddp_fork' or " in message
    assert "Use strategy='ddp'" in message
    assert "_call_setup_hook" in message and "training_step" not in message  # raised in setup: nothing trained
    assert not list(tmp_path.glob("rank*.pt"))


if __name__ == "__main__":
    _job(sys.argv[1], Path(sys.argv[2]))
