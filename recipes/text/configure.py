"""How the LM recipe sets its model up on the trainer (:meth:`recipes.text.byte_lm.ByteLM.configure_model`):
FSDP2's sharding (``--trainer.strategy fsdp2``, :class:`FSDP2Strategy`) and then ``torch.compile``
(``--model.compile``), each one decoder layer at a time.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from recipes.text.causal_lm import decoder_layers
from recipes.common.errors import UsageError

__all__ = ["FSDP2Strategy", "compile_layers", "shard_layers"]


def shard_layers(model: nn.Module, mesh: Any) -> str:
    """FSDP2's ``fully_shard`` on every decoder layer, then on the whole model, over ``mesh``'s data-parallel
    processes (one all-gather per block, as transformers' own FSDP wrapping does); what was done, in words.

    Raises:
        UsageError: a mesh with tensor parallelism (the recipe shards data-parallel only).
    """
    from torch.distributed.fsdp import fully_shard

    if "tensor_parallel" in mesh.mesh_dim_names and mesh["tensor_parallel"].size() > 1:
        raise UsageError("ModelParallelStrategy: the LM recipe shards data-parallel only (FSDP2); give it "
                         "tensor_parallel_size=1.")
    dp = mesh["data_parallel"]
    layers = decoder_layers(model)
    kinds = ", ".join(sorted({type(layer).__name__ for layer in layers})) or "no decoder layer found"
    for layer in layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return f"FSDP2: fully_shard on {len(layers)} decoder layers ({kinds}) and the whole model, over {dp.size()} processes"


def compile_layers(model: nn.Module) -> str:
    """``torch.compile`` the model's decoder layers in place (``nn.Module.compile``), one block at a time as
    torchtitan does; what was compiled, in words.

    In place, so the weights keep their names (checkpoints, the Hugging Face export and the monitors' tags
    are the eager run's); per block, so FSDP2's per-layer hooks stay between the graphs, and layers alike
    share their compiled code (Dynamo treats their parameters as inputs). The embeddings, the final norm and
    the head run eagerly. Inside the graphs the MRSNorm layers call the op's custom operators, so Inductor
    keeps their hand-written kernels (docs/performance.md#torchcompile-and-torchfunc). A model that names no
    decoder layer (transformers' ``_no_split_modules``) is compiled whole, and the words say so.
    """
    layers = decoder_layers(model)
    if not layers:
        model.compile()
        return f"the whole {type(model).__name__} (it names no decoder layer in _no_split_modules)"
    for layer in layers:
        layer.compile()
    kinds = ", ".join(sorted({type(layer).__name__ for layer in layers}))
    return f"{len(layers)} decoder layers ({kinds}), each in place"


class FSDP2Strategy(ModelParallelStrategy):
    """``--trainer.strategy fsdp2``: ModelParallelStrategy sharding over every process, no tensor parallelism.

    ModelParallelStrategy's ``"auto"`` sizes make every device of a node tensor-parallel; the
    recipe's :meth:`recipes.text.byte_lm.ByteLM.configure_model` shards data-parallel only
    (:func:`shard_layers`), so its data-parallel group is all the processes.
    """

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()
