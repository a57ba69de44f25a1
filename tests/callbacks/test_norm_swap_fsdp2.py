"""NormSwap under FSDP2 (Lightning's ``ModelParallelStrategy``): 2 gloo processes on the CPU.

The LightningModule builds a tiny Llama in ``__init__`` and shards it in ``configure_model``
(``fully_shard`` per decoder layer, then the root), as Lightning's FSDP2 guide does. NormSwap
swaps the unsharded model in ``setup``, before Lightning calls ``configure_model``: the
sharded model trains with MRSNorm body norms and MRS QK-norms; its checkpoint (a directory of
shards) restores in the test process onto a freshly built, unsharded model, and (slow) resumes.

Run as a script (``python tests/callbacks/test_norm_swap_fsdp2.py MODE OUT_DIR``) this file is
the job: Lightning's launcher re-runs the same command line for rank 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers.ddp import run_job
from helpers.hf_attention import TinyLM, token_data, tokens
from lightning_mrs import MRSNorm
from lightning_mrs.callbacks import NormSwap

STEPS, MORE = 3, 2
X = tokens(2, 7, seed=3)


class ShardedLM(TinyLM):
    """:class:`TinyLM` sharded with FSDP2 in ``configure_model`` (idempotent)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _job(mode: str, out: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from helpers.lightning import fit

    torch.manual_seed(0)
    module = ShardedLM("llama")
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    resume = mode == "resume"
    trainer, module = fit(module, steps=STEPS + MORE * resume, data=token_data(8, 7), batch_size=2,
                          callbacks=[NormSwap("mrs", qk_norm="mrs", verbose=False)], strategy=strategy, devices=2,
                          ckpt_path=str(out / "sharded.ckpt") if resume else None)
    if not resume:
        trainer.save_checkpoint(out / "sharded.ckpt")  # a directory of shards and meta.pt
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        logits = module.eval()(X)  # every rank: the forward all-gathers the shards
    if trainer.is_global_zero:
        kinds = {n: type(m).__name__ for n, m in module.named_modules() if n.endswith(("norm", "layernorm"))}
        torch.save({"state": full, "logits": logits, "kinds": kinds}, out / f"{mode}.pt")
        (out / f"{mode}.json").write_text(json.dumps({"steps": trainer.global_step}))


def _run(mode: str, out: Path) -> dict:
    proc = run_job(Path(__file__), mode, str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((out / f"{mode}.json").read_text())["steps"] == STEPS + MORE * (mode == "resume")
    return torch.load(out / f"{mode}.pt")


def _fit_and_check(out: Path) -> dict:
    trained = _run("fit", out)
    assert set(trained["kinds"].values()) == {"MRSNorm"} and len(trained["kinds"]) == 2 * 4 + 1  # QK-norms too
    fresh_state = TinyLM("llama").state_dict()
    assert any(not torch.equal(trained["state"][k], fresh_state[k]) for k in fresh_state if "layernorm" in k)
    return trained


def test_fsdp2_trains_the_swapped_model_checkpoints_and_restores(tmp_path):
    trained = _fit_and_check(tmp_path)
    restored = NormSwap.restore(ShardedLM("llama"), tmp_path / "sharded.ckpt").eval()  # no device mesh needed
    assert isinstance(restored.model.model.layers[0].self_attn.q_norm, MRSNorm)
    got = restored.state_dict()
    assert list(got) == list(trained["state"])
    for key, value in trained["state"].items():
        assert torch.equal(got[key], value), key
    with torch.no_grad():
        torch.testing.assert_close(restored(X), trained["logits"], atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # two 2-process jobs (about a minute on 2 busy cores)
def test_fsdp2_resumes_from_its_shards(tmp_path):
    trained = _fit_and_check(tmp_path)
    resumed = _run("resume", tmp_path)  # 2 more steps from the shards, NormSwap's record checked
    assert list(resumed["state"]) == list(trained["state"])
    assert any(not torch.equal(resumed["state"][k], v) for k, v in trained["state"].items())


if __name__ == "__main__":
    _job(sys.argv[1], Path(sys.argv[2]))
