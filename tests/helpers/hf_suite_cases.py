"""Test cases for transformers' own ``ModelTesterMixin``, on swapped Llama, Qwen3 and Gemma 3 models.

Not collected by our suite (not ``test_*.py``): ``tests/peers/test_transformers_common.py`` runs
it in a pytest subprocess, with ``LMRS_HF_SUITE`` naming the package (built at test time) that
holds transformers' ``tests/test_modeling_common.py`` from the sdist of the installed
transformers, unchanged. The model testers below follow transformers' own (``CausalLMModelTester``
in transformers' repository, not shipped in the sdist): a tiny config, ``input_ids`` and an
``attention_mask``.

Each family runs under several *variants*: ``plain`` is transformers' own classes (the baseline);
every other variant's classes are stand-ins of the same name (the suite decides what to feed a
class by its ``__name__``) whose construction applies ``lightning_mrs.swap_norms`` and whose
``from_pretrained`` is ``lightning_mrs.from_pretrained``. ``loader`` swaps nothing (our loader
alone), ``mrs``/``rms``/``layer`` swap every norm, ``mrs-qk`` adds MRS QK-norms to Llama (which
has none). Only the save/load tests named in ``SELECTED`` run. Each load is recorded (one JSON line
to ``LMRS_HF_RECORD``): whether the loaded model's norm layers are those a fresh construction from
its config builds, so a load that silently drops the swap is caught even where the suite passes.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import unittest
from typing import Any, Callable

import torch
import transformers
from torch import nn

import lightning_mrs
from lightning_mrs.swap.hf_format import RECORD_KEY, live_layers, saved_config

from helpers.hf_suite_selected import SELECTED, VARIANTS

_suite = importlib.import_module(f"{os.environ.get('LMRS_HF_SUITE', 'lmrs_hf_suite')}.test_modeling_common")
ModelTesterMixin = _suite.ModelTesterMixin
ids_tensor = _suite.ids_tensor


def _record(entry: dict[str, Any]) -> None:
    path = os.environ.get("LMRS_HF_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _layer_kinds(model: nn.Module) -> dict[str, str]:
    """Class of every module whose name ends in ``norm`` (the norms, QK-norms included)."""
    return {name: type(m).__name__ for name, m in model.named_modules() if name.rpartition(".")[2].endswith("norm")}


def swapped(base: type, variant: str) -> type:
    """A stand-in for ``base`` (same ``__name__``) built swapped to ``variant`` and loaded by our loader."""
    options = VARIANTS[variant]

    def __init__(self: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, config, *args, **kwargs)
        if options:
            lightning_mrs.swap_norms(self, **options)

    @classmethod  # type: ignore[misc]
    def from_pretrained(cls: type, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config")
        if options and isinstance(config, transformers.PretrainedConfig) and RECORD_KEY not in config.to_dict():
            # a config object given to this class is this class's config: it carries the class's swap,
            # as the config a model of this class saves does (the record is what our loader reads)
            kwargs["config"] = saved_config(cls(copy.deepcopy(config)))
        loaded = lightning_mrs.from_pretrained(pretrained_model_name_or_path, *args, auto_class=base, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        # the norm layers a fresh construction from the loaded config builds (the loaded model must have them)
        fresh = cls(copy.deepcopy(model.config))
        kinds, want = _layer_kinds(model), _layer_kinds(fresh)
        _record({"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0], "class": base.__name__,
                 "variant": variant, "recorded": bool(live_layers(model)), "norms": len(want),
                 "kinds": sorted(set(kinds.values())),
                 "differ": sorted(n for n in set(kinds) | set(want) if kinds.get(n) != want.get(n))})
        return loaded

    return type(base.__name__, (base,), {"__init__": __init__, "from_pretrained": from_pretrained,
                                         "__module__": __name__, "__qualname__": base.__name__})


class CausalLMTester:
    """A tiny decoder and its inputs, after transformers' ``CausalLMModelTester``."""

    def __init__(self, parent: unittest.TestCase, config_class: type, **config: Any) -> None:
        self.parent, self.config_class, self.extra = parent, config_class, config
        self.batch_size, self.seq_length, self.is_training = 13, 7, True
        self.vocab_size, self.hidden_size, self.num_hidden_layers = 99, 32, 2
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = 4, 2, 8
        self.intermediate_size, self.pad_token_id, self.num_labels = 37, 0, 3

    def get_config(self) -> Any:
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, max_position_embeddings=64,
            pad_token_id=self.pad_token_id, num_labels=self.num_labels, **self.extra)

    def prepare_config_and_inputs_for_common(self) -> tuple[Any, dict[str, torch.Tensor]]:
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = torch.tril(torch.ones_like(input_ids))  # left-aligned sequences, as the testers make them
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


FAMILIES: dict[str, tuple[type, dict[str, Any], tuple[type, ...]]] = {
    "Llama": (transformers.LlamaConfig, {}, (transformers.LlamaModel, transformers.LlamaForCausalLM,
                                             transformers.LlamaForSequenceClassification)),
    "Qwen3": (transformers.Qwen3Config, {}, (transformers.Qwen3Model, transformers.Qwen3ForCausalLM,
                                             transformers.Qwen3ForSequenceClassification)),
    "Gemma3": (transformers.Gemma3TextConfig, {"sliding_window": 4}, (
        transformers.Gemma3TextModel, transformers.Gemma3ForCausalLM, transformers.Gemma3TextForSequenceClassification)),
}


def _case(family: str, variant: str) -> type:
    config_class, extra, classes = FAMILIES[family]
    if variant != "plain":
        classes = tuple(swapped(c, variant) for c in classes)

    def setUp(self: unittest.TestCase) -> None:  # noqa: N802 - unittest's name
        self.model_tester = CausalLMTester(self, config_class, **extra)

    body: dict[str, Any] = {"all_model_classes": classes, "setUp": setUp, "__module__": __name__}
    # every test of the mixin that is not a save/load test is removed (None: not collected)
    # (the flags named test_* - test_mismatched_shapes, test_missing_keys... - are not tests: they stay)
    body.update({name: None for name in dir(ModelTesterMixin)
                 if name.startswith("test_") and name not in SELECTED and callable(getattr(ModelTesterMixin, name))})
    name = f"Test{family}_{variant.replace('-', '_')}"
    return type(name, (ModelTesterMixin, unittest.TestCase), body)


def _families(make: Callable[[str, str], type]) -> dict[str, type]:
    cases = {}
    for family in FAMILIES:
        for variant in ("plain", *VARIANTS):
            if variant == "mrs-qk" and family != "Llama":  # Qwen3 and Gemma 3 have QK-norms: "mrs" swaps them
                continue
            case = make(family, variant)
            cases[case.__name__] = case
    return cases


globals().update(_families(_case))
