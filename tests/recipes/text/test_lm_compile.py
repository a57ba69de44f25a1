"""recipes/lm.py --model.compile: the decoder layers compiled in place, and a compiled fit that is the eager one.

The compiled fit runs Inductor on the CPU (the MRSNorm layers inside the graphs call the op's C++
operators) and is compared, loss by loss and weight by weight, with the same seeds run eagerly;
the checkpoint and the Hugging Face export must hold the same names as the eager run's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers.lm import TINY
from recipes.common.interrupt import last_checkpoint
from recipes.text.configure import compile_layers

pytest.importorskip("transformers")

MRS = ["--model.norm", "mrs", "--trainer.max_steps", "4", "--model.sample_bytes", "0"]


def _fit(args: list[str], monkeypatch: pytest.MonkeyPatch):
    from recipes.lm import build_cli

    monkeypatch.setattr(sys, "argv", ["lm.py"])
    torch._dynamo.reset()
    cli = build_cli(args)
    losses: list[float] = []  # each step's loss as training_step returned it, unrounded
    step = cli.model.training_step

    def recording_step(batch, batch_idx):
        loss = step(batch, batch_idx)
        losses.append(float(loss))
        return loss

    monkeypatch.setattr(cli.model, "training_step", recording_step)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli, losses


def test_compile_layers_compiles_each_decoder_layer_in_place() -> None:
    from recipes.text.model import build_byte_model

    model, _ = build_byte_model("llama", {"num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 2,
                                          "intermediate_size": 64}, "mrs", "none", "auto", 16)
    names = list(model.state_dict())
    said = compile_layers(model)
    layers = model.model.layers
    assert said == "3 decoder layers (LlamaDecoderLayer), each in place"
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert model._compiled_call_impl is None and model.model.norm._compiled_call_impl is None  # the rest: eager
    assert list(model.state_dict()) == names  # no _orig_mod: checkpoints and the export keep their names

    plain = nn.Sequential(nn.Linear(4, 4))  # names no decoder layer: compiled whole, and said
    assert compile_layers(plain) == "the whole Sequential (it names no decoder layer in _no_split_modules)"
    assert plain._compiled_call_impl is not None


#: precision -> (rtol, atol) of the losses and of the weights after the steps, compiled against eager
TOLERANCES = {"32-true": ((1e-4, 1e-5), (1e-3, 1e-5)), "bf16-mixed": ((2e-2, 1e-3), (5e-2, 2e-3))}


@pytest.mark.parametrize("precision", ["32-true", pytest.param("bf16-mixed", marks=pytest.mark.slow)])
def test_compiled_fit_is_the_eager_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    args = [*TINY, *MRS, "--trainer.precision", precision]
    eager, eager_losses = _fit([*args, "--trainer.default_root_dir", str(tmp_path / "eager")], monkeypatch)
    torch._dynamo.utils.counters.clear()
    compiled, compiled_losses = _fit([*args, "--model.compile", "true",
                                      "--trainer.default_root_dir", str(tmp_path / "compiled")], monkeypatch)
    (loss_rtol, loss_atol), (rtol, atol) = TOLERANCES[precision]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # Inductor ran: the steps were compiled
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.model.model.layers)
    assert compiled.trainer.global_step == eager.trainer.global_step == 4
    assert compiled.model.activation_dtype == eager.model.activation_dtype  # the dtype watch saw the compiled layer
    # Inductor sums and rounds in another order than eager: rounding, nothing more
    torch.testing.assert_close(torch.tensor(compiled_losses), torch.tensor(eager_losses), rtol=loss_rtol, atol=loss_atol)
    ours, theirs = compiled.model.state_dict(), eager.model.state_dict()
    assert list(ours) == list(theirs)
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name], weight, rtol=rtol, atol=atol, msg=name)
    saved = torch.load(last_checkpoint(compiled.trainer), map_location="cpu", weights_only=False)
    assert list(saved["state_dict"]) == list(theirs) and saved["hyper_parameters"]["compile"] is True
    exported = Path(compiled.trainer.log_dir) / "hf"
    assert (exported / "config.json").is_file()


def test_compile_may_change_on_resume() -> None:
    from recipes.common.checkpoints import MAY_CHANGE
    from recipes.lm import RESUME

    assert RESUME["--model.compile"] == MAY_CHANGE  # the same weights, compiled or not
