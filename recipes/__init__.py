"""Training recipes of lightning-mrs: ``cifar100.py`` (LightningCLI) and ``stress.py`` (the paper's grid).

Their data: ``data.py`` (CIFAR-100, scikit-learn's digits, your image folders, or ``synthetic.py``).
Run them as scripts from the repository root, e.g. ``python recipes/cifar100.py --help``.
"""
