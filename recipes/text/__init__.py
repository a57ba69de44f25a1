"""The language-model recipe (``recipes/lm.py``): the LightningModule (:mod:`.byte_lm`), the model built in one
place (:mod:`.model`) from a transformers config (:mod:`.causal_lm`) or a checkpoint (:mod:`.pretrained`), the
swap's check (:mod:`.checks`), its placement on the trainer (:mod:`.configure`: compile, FSDP2), the text
(:mod:`.corpus`, :mod:`.token_cache`) and its DataModule (:mod:`.data`), and the Hugging Face export
(:mod:`.export`).
"""
