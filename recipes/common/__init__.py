"""What the image and the text recipes share: the LightningCLI helpers and callbacks (:mod:`.training`),
``--ckpt_path`` and resume checks (:mod:`.checkpoints`), Ctrl-C and crashes (:mod:`.interrupt`), the HParams
dashboard (:mod:`.hparams`), optimizers and schedules (:mod:`.optim`), and the one-line user mistake
(:mod:`.errors`).
"""
