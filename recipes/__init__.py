"""Training recipes of lightning-mrs: ``cifar100.py`` (LightningCLI) and ``stress.py`` (the stress sweeps).

The model: ``classifier.py`` (``ImageClassifier``); the data: ``data.py`` (CIFAR-100, scikit-learn's
digits, your image folders, or ``synthetic.py``); the sweeps' package: ``sweeps/``. Run the recipes as
scripts from the repository root, e.g. ``python recipes/cifar100.py --help``.
"""

import importlib.util

#: what the recipes import beyond the core, as the ``recipes`` extra installs it
_NEEDS = ("lightning", "torchvision", "timm", "torchmetrics", "tensorboard", "jsonargparse", "matplotlib", "scipy",
          "tqdm", "sklearn", "transformers")
_MISSING = [name for name in _NEEDS if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(f"the recipes need {', '.join(_MISSING)}: pip install -e '.[recipes]' (from the repository root)")
