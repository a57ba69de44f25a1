"""A swapped model's ``peft_config``: PEFT's ``AutoPeftModelFor<Task>`` opens an adapter saved without a task.

PEFT's ``save_pretrained`` records the base model of an adapter config without a ``task_type`` by
its class and module (``auto_mapping``), and ``AutoPeftModel*`` imports only allowlisted libraries
(transformers...): ``LightningMRS<Base>`` lives in lightning-mrs, so the adapter was refused. PEFT's
tuner hands the model its adapter configs (``model.peft_config = {name: config}``); a swapped class's
``peft_config`` property gives a *copy* of each task-less config the task of the Auto class the class
is registered for, so the adapter records the task, and ``AutoPeftModelFor<Task>.from_pretrained(
adapter, trust_remote_code=True)`` builds the base through that Auto class, as for any custom model.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

__all__ = ["peft_config"]

#: the PEFT task of each Auto class that ``AutoPeftModelFor<Task>`` builds the base model with
_PEFT_TASKS = {"AutoModelForCausalLM": "CAUSAL_LM", "AutoModelForSequenceClassification": "SEQ_CLS",
               "AutoModelForTokenClassification": "TOKEN_CLS", "AutoModelForQuestionAnswering": "QUESTION_ANS",
               "AutoModelForSeq2SeqLM": "SEQ_2_SEQ_LM", "AutoModel": "FEATURE_EXTRACTION"}


def _peft_configs(self: nn.Module) -> Any:
    try:
        return self.__dict__["peft_config"]
    except KeyError:
        raise AttributeError("peft_config") from None  # nn.Module.__getattr__ says it in full


def _set_peft_configs(self: nn.Module, configs: Any) -> None:
    """Keep ``configs``, each task-less (non prompt-learning) config replaced by a copy with the task of
    ``type(self)._auto_class``; the caller's config objects are not changed."""
    task = _PEFT_TASKS.get(getattr(type(self), "_auto_class", None) or "")
    if task is not None and isinstance(configs, dict):
        for name, config in list(configs.items()):
            if getattr(config, "task_type", task) is None and not getattr(config, "is_prompt_learning", True):
                configs[name] = copy.copy(config)
                configs[name].task_type = task
    self.__dict__["peft_config"] = configs


def _del_peft_configs(self: nn.Module) -> None:
    if self.__dict__.pop("peft_config", None) is None:
        raise AttributeError("peft_config")


#: the property ``LightningMRS<Base>`` defines
peft_config = property(_peft_configs, _set_peft_configs, _del_peft_configs)
