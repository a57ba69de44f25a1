"""Training recipes of lightning-mrs: ``cifar100.py`` (LightningCLI) and ``stress.py`` (the stress sweeps).

The model: ``classifier.py`` (``ImageClassifier``); the data: ``data.py`` (CIFAR-100, scikit-learn's
digits, your image folders, or ``synthetic.py``); the sweeps' package: ``sweeps/``. Run the recipes as
scripts from the repository root, e.g. ``python recipes/cifar100.py --help``.
"""
