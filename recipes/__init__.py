"""Training recipes of lightning-mrs. On top, what you run (from the repository root): ``cifar100.py`` (an image
classifier, LightningCLI), ``lm.py`` (a causal language model, LightningCLI), ``stress.py`` (the stress
sweeps), ``export_hf.py`` (an LM checkpoint as a Hugging Face directory), and ``configs/``; e.g.
``python recipes/cifar100.py --help``.

What they are built from: ``vision/`` (the image classifier, its models and DataModules), ``text/`` (the
causal LM module, its model, text and DataModule), ``common/`` (what both use: training helpers, checkpoints,
interrupts, HParams, optimizers, usage errors), and ``sweeps/`` (the sweeps' runner, kinds, claims and cells).
"""

import importlib.util

#: what the recipes import beyond the core, as the ``recipes`` extra installs it
_NEEDS = ("lightning", "torchvision", "timm", "torchmetrics", "tensorboard", "jsonargparse", "matplotlib", "scipy",
          "tqdm", "sklearn", "transformers", "torchdata")
_MISSING = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(f"the recipes need {', '.join(_MISSING)}: pip install -e '.[recipes]' (from the repository root)")
