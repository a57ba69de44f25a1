"""Which of transformers' common tests run on which variants (``tests/helpers/hf_suite_cases.py``).

Apart from the cases so that ``tests/peers/test_transformers_common.py`` reads them without
importing the fetched suite. A test is selected when it saves, loads or initialises weights
(``save_pretrained``, ``from_pretrained``, state dicts, tied and ignored keys, mismatched shapes,
``dtype``/device/offload keywords, missing-weight initialisation): what a norm swap and our loader
can break. Forward/backward/attention tests are out of scope (timm's and our own suites cover them).
"""

from __future__ import annotations

from typing import Any

#: the save/load tests of ``ModelTesterMixin`` that run (every other test is removed from the classes)
SELECTED = (
    "test_save_load",  # save, reload, same outputs (twice: the config fields from_pretrained adds)
    "test_from_pretrained_no_checkpoint",  # from_pretrained(None, config=, state_dict=)
    "test_save_load_keys_to_ignore_on_save",
    "test_load_contiguous_weights",
    "test_torch_save_load",  # torch.save of the state dict, transformers' load_state_dict
    "test_correct_missing_keys",  # a base model's weights into a head model: the head is "missing"
    "test_base_model_prefix_loads_base_weights",
    "test_can_use_safetensors",  # tied weights through safetensors
    "test_load_save_without_tied_weights",
    "test_tied_weights_keys",
    "test_model_weights_reload_no_missing_tied_weights",
    "test_load_with_mismatched_shapes",  # a new head: refused, then ignore_mismatched_sizes=True
    "test_can_load_ignoring_mismatched_shapes",
    "test_keep_in_fp32_modules_exist", "test_keep_in_fp32_modules",
    "test_keep_in_fp32_modules_strict_also_hardcode_fp32",
    "test_bc_torch_dtype",  # dtype= and torch_dtype= on from_pretrained
    "test_can_load_with_device_context_manager", "test_can_load_with_global_device_set",
    "test_cannot_load_with_meta_device_context_manager",
    "test_can_load_from_already_mapped_keys", "test_reverse_loading_mapping",  # key renaming on load
    "test_disk_offload_bin", "test_disk_offload_safetensors", "test_cpu_offload",  # device_map (need an accelerator)
    "test_model_parallelism",
    "test_can_init_all_missing_weights", "test_init_weights_can_init_buffers",  # missing weights initialised
)

VARIANTS: dict[str, dict[str, Any]] = {
    "loader": {}, "mrs": {"target": "mrs"}, "rms": {"target": "rms"}, "layer": {"target": "layer"},
    "mrs-qk": {"target": "mrs", "qk_norm": "mrs"},
}
