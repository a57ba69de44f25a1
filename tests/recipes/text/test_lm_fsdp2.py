"""FSDP2 (``--trainer.strategy fsdp2``) on 2 CPU processes, in float16 with its loss scaler and in float32.

Under ``fully_shard`` each process holds a shard of every gradient, so an Inf in one process's shard is
invisible to the others unless the scaler's check is reduced over the shards; otherwise that process
skips the step and halves its scale while the others step, and the shards of one model drift apart.
The float16 run plants an Inf in rank 1's shard at step 1 (:class:`helpers.fsdp2.PlantInf`) and checks
that both processes skipped that step and kept the same scale.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ROOT
from helpers.ddp import run_job
from helpers.lm import OWN_NORMS, TINY


def _fsdp2_run(tmp_path: Path, precision: str, *extra: str) -> str:
    proc = run_job(ROOT / "recipes" / "lm.py", *TINY, *OWN_NORMS, "--trainer.devices", "2", "--trainer.strategy",
                   "fsdp2", "--trainer.precision", precision, "--trainer.default_root_dir", str(tmp_path / "run"),
                   *extra, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "global batch 8 windows of 32 bytes = 4 per device x 2 processes" in out
    assert "FSDP2: fully_shard on 2 decoder layers (LlamaDecoderLayer) and the whole model, over 2 processes" in out
    assert "fit: 3 steps in" in out
    assert (tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_dir()  # sharded
    return out


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_fsdp2_in_float16_skips_an_overflow_on_every_shard(tmp_path: Path) -> None:
    out = _fsdp2_run(tmp_path, "16-mixed", "--trainer.callbacks+=helpers.fsdp2.PlantInf",
                     f"--trainer.callbacks.out={tmp_path}")
    assert "precision 16-mixed: activations ran in torch.float16 (MixedPrecision, loss scaler GradScaler on cpu)" in out
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1], ranks  # the same steps skipped, the same scale, on both processes
    before, planted = ranks[0][0], ranks[0][1]
    assert planted == {"scale": before["scale"] / 2, "stepped": False}, ranks  # the Inf of rank 1's shard only
    assert ranks[0][2]["stepped"]
    _export_the_shards(tmp_path)


def _export_the_shards(tmp_path: Path) -> None:
    """The directory of shards loads in one process (ByteLM.load_from_checkpoint) and exports (recipes/export_hf.py)."""
    import torch

    from lightning_mrs import from_pretrained
    from recipes.text.byte_lm import ByteLM
    from recipes.export_hf import run

    shards = tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    module = ByteLM.load_from_checkpoint(shards)
    assert run([str(shards), str(tmp_path / "hf")]) == 0
    ids = torch.tensor([list(b"def f(x):")])
    with torch.no_grad():
        assert torch.equal(from_pretrained(tmp_path / "hf").eval()(ids).logits, module.model.eval()(ids).logits)


@pytest.mark.slow
def test_fsdp2_in_float32_on_two_cpu_processes(tmp_path: Path) -> None:
    out = _fsdp2_run(tmp_path, "32-true")
    assert "precision 32-true: activations ran in torch.float32" in out


@pytest.mark.slow  # two processes compiling: about 30 s on 2 idle cores, and the eager run
def test_fsdp2_with_compiled_layers_is_the_eager_fsdp2_run(tmp_path: Path) -> None:
    def fit_line(out: str) -> str:
        line = next(ln for ln in out.splitlines() if ln.startswith("fit: 3 steps in"))
        return line.split(";", 1)[1]  # "val/bpb ... (a unigram model ...)": not the seconds

    eager = _fsdp2_run(tmp_path / "eager", "32-true", "--model.norm", "mrs")
    compiled = _fsdp2_run(tmp_path / "compiled", "32-true", "--model.norm", "mrs", "--model.compile", "true")
    assert "torch.compile: 2 decoder layers (FSDPLlamaDecoderLayer), each in place" in compiled  # after fully_shard
    assert "torch.compile" not in eager
    assert fit_line(compiled) == fit_line(eager)  # val/bpb to the printed digits
