"""The LM recipe's tiny command line for the tests, and running it in-process as a user's command."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

__all__ = ["OWN_NORMS", "TINY", "TINY_CONFIG", "LMRun", "final_weights"]

TINY_CONFIG = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
               "intermediate_size": 64}
TINY = ["--model.config", json.dumps(TINY_CONFIG), "--data.seq_len", "32", "--data.batch_size", "4",
        "--data.val_windows", "8", "--trainer.accelerator", "cpu", "--trainer.max_steps", "3",
        "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1", "--model.sample_bytes", "8",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
OWN_NORMS = ["--model.norm", "none"]


class LMRun:
    """``recipes/lm.py``'s :func:`run` in-process: ``lm(args) -> (exit status, output)``; the output is what
    it printed and what Lightning logged (``rank_zero_info`` lines reach pytest through the logging), also
    in :attr:`output` when the run raised."""

    def __init__(self, capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
        self.capfd, self.caplog = capfd, caplog
        self.output = ""

    def __call__(self, args: list[str]) -> tuple[int, str]:
        from recipes.lm import run

        self.caplog.set_level(logging.INFO, logger="lightning.pytorch")  # as on a terminal (a sweep cell sets WARNING)
        self.caplog.clear()
        try:
            status = run(args)
        finally:
            captured = self.capfd.readouterr()
            self.output = captured.out + captured.err + self.caplog.text
        return status, self.output


def final_weights(checkpoint: Path) -> dict[str, Any]:
    """The weights and optimizer step of a Lightning checkpoint file."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return {"step": saved["global_step"], "state_dict": saved["state_dict"]}
