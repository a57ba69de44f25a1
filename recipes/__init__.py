"""Training recipes of lightning-mrs: ``cifar100.py`` (LightningCLI) and ``stress.py`` (the paper's grid).

Run them as scripts from the repository root, e.g. ``python recipes/cifar100.py --help``.
"""
