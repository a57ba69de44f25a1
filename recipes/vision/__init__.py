"""The image recipe (``recipes/cifar100.py``): the classifier (:mod:`.classifier`), its model builder
(:mod:`.models`), its DataModule (:mod:`.data`: CIFAR-100, scikit-learn's digits, an image folder, or
:mod:`.synthetic`) and the offline image sources (:mod:`.datasets`).
"""
