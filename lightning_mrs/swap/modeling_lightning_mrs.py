"""The code ``save_pretrained`` writes beside a model whose norms lightning-mrs swapped.

``config.json``'s ``auto_map`` names ``modeling_lightning_mrs.LightningMRS<Base>`` for
``AutoConfig`` and for every Auto class of the model's family, so that transformers (with
``trust_remote_code=True``), ``pipeline``, PEFT and lm-evaluation-harness load the directory.
This file calls one public entry point of the installed lightning-mrs,
``lightning_mrs.transformers_class``, with the record format it was written for: a release that
reads another format says so, and which release to install.
"""

from lightning_mrs import transformers_class

RECORD_FORMAT = 2


def __getattr__(name: str) -> type:
    return transformers_class(name, RECORD_FORMAT)
