"""The Hugging Face exits of a swapped model (issue 61, cases 1, 2 and 7): each way a swapped model
leaves through ``save_pretrained`` and comes back is equal to the saved model (logits
``torch.equal``) or refused in one line before a layer is built.

1. The family's own class (``LlamaForCausalLM.from_pretrained(d)``, no ``trust_remote_code``) and
   another head of the family refuse a swapped directory with the guard's message, whatever
   ``attn_implementation=`` says; they built the plain norms before (``rms-half``: no key reported).
2. No plain model inherits the record: a config read from the directory (by the family's config
   class or by ``AutoConfig`` with ``trust_remote_code``) refuses to build the family's class; a
   loaded swapped model's config is the family's, and the plain model built from it saves and loads
   back through the family's class equal.
3. (case 7) ``AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True)`` opens a LoRA
   adapter saved without a ``task_type`` on a swapped base, equal to the adapted model; PEFT's import
   allowlist refused it before.

Every case runs for Llama and Gemma (``(1 + w)`` norms) swapped to ``rms-half``, ``layer``, ``dyt``,
``mrs`` and to an added QK-norm, and for the QK-norms of Qwen3 and Gemma 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.hf import tiny_causal_lm, token_batch, transformers
from lightning_mrs import from_pretrained, swap_norms
from lightning_mrs.swap.hf_guard import guard_text

CELLS = {
    **{f"{family}-{target}": (family, dict(target=target))
       for family in ("llama", "gemma") for target in ("rms-half", "layer", "dyt", "mrs")},
    "llama-qk": ("llama", dict(target=None, qk_norm="mrs")),  # QK-norms added
    "gemma-qk": ("gemma", dict(target=None, qk_norm="rms")),
    "qwen3-qk": ("qwen3", dict(target="layer", qk_norm="layer")),  # its own QK-norms swapped
    "gemma3_text-qk": ("gemma3_text", dict(target=None, qk_norm="mrs")),
}
#: the family's own classes, as a script that knows the architecture imports them
FAMILY = {"llama": "Llama", "gemma": "Gemma", "qwen3": "Qwen3", "gemma3_text": "Gemma3"}


@pytest.fixture(autouse=True)
def _quiet_transformers():
    transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each cell's swapped model ("trained": no 1-d weight at its init) and the directory it saved."""
    out = {}
    for cell, (family, options) in CELLS.items():
        model = tiny_causal_lm(family)
        swap_norms(model, **options)
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.05 * torch.randn_like(p))
        path = tmp_path_factory.mktemp(cell)
        model.save_pretrained(path)
        assert json.loads((path / "config.json").read_text())["lightning_mrs"]["layers"], cell
        out[cell] = model, path
    return out


def _family(cell: str, head: str = "ForCausalLM") -> type:
    return getattr(transformers, FAMILY[CELLS[cell][0]] + head)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(token_batch()).logits


def _refused_by_the_guard(build, key: str = "attn_implementation") -> None:
    with pytest.raises(ValueError) as err:
        build()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f'Specified `{key}="{guard_text(2)}"` is not supported.'), message


@pytest.mark.parametrize("cell", CELLS)
def test_the_family_class_refuses_a_swapped_directory(saved, cell):
    model, path = saved[cell]
    _refused_by_the_guard(lambda: _family(cell).from_pretrained(path))
    # attn_implementation= replaces one guard; the second refuses
    _refused_by_the_guard(lambda: _family(cell).from_pretrained(path, attn_implementation="eager"), "experts_implementation")
    _refused_by_the_guard(lambda: _family(cell, "ForSequenceClassification").from_pretrained(path, num_labels=3))
    # the two ways in the message give the saved model
    for again in (from_pretrained(path, attn_implementation="eager"),
                  transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, attn_implementation="eager")):
        assert torch.equal(_logits(again), _logits(model))


def test_the_refusal_comes_before_a_layer_is_built(saved, monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("a norm was built")

    monkeypatch.setattr(transformers.models.gemma.modeling_gemma.GemmaRMSNorm, "__init__", built)
    _refused_by_the_guard(lambda: transformers.GemmaForCausalLM.from_pretrained(saved["gemma-rms-half"][1]))


@pytest.mark.parametrize("cell", CELLS)
def test_no_plain_model_inherits_the_record(saved, cell, tmp_path):
    model, path = saved[cell]
    family_config = _family(cell).config_class
    for config in (family_config.from_pretrained(path), transformers.AutoConfig.from_pretrained(path, trust_remote_code=True)):
        _refused_by_the_guard(lambda: _family(cell)(config))
        _refused_by_the_guard(lambda: _family(cell).from_pretrained(path, config=config))
    loaded = from_pretrained(path, attn_implementation="eager")
    config = loaded.config
    assert type(config) is family_config and config.model_type == family_config.model_type
    assert not {"lightning_mrs", "auto_map"} & set(config.to_dict())
    assert config._attn_implementation == "eager" and config._experts_implementation != guard_text(2)
    plain = transformers.AutoModelForCausalLM.from_config(config)
    assert type(plain) is _family(cell)
    plain.save_pretrained(tmp_path / "plain")
    assert "auto_map" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    again = _family(cell).from_pretrained(tmp_path / "plain", attn_implementation="eager")
    assert torch.equal(_logits(again), _logits(plain.eval()))


@pytest.mark.parametrize("cell", CELLS)
def test_auto_peft_model_opens_an_adapter_saved_without_a_task_type(saved, cell, tmp_path):
    peft = pytest.importorskip("peft")
    _, path = saved[cell]
    base = from_pretrained(path, attn_implementation="eager")  # as a user fine-tunes a saved model
    lora_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(base, lora_config)
    lora.save_pretrained(tmp_path / "adapter")
    assert lora_config.task_type is None  # the caller's config is not changed
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", trust_remote_code=True,
                                                            attn_implementation="eager")
    assert type(loaded.get_base_model()) is type(base)
    assert torch.equal(_logits(loaded), _logits(lora))
