"""The LM recipe on a pretrained checkpoint: its tokenizer, bits per byte across tokenizers, the export.

The "pretrained" checkpoint is a tiny Llama saved with ``save_pretrained`` beside a byte-level BPE
trained offline on stdlib text (:mod:`helpers.tokenizers`); nothing is downloaded.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers.lm import LMRun
from helpers.tokenizers import save_tokenizer, tiny_tokenizer
from lightning_mrs import MRSNorm, from_pretrained

transformers = pytest.importorskip("transformers")

RUN = ["--data.seq_len", "32", "--data.batch_size", "4", "--data.val_windows", "8", "--trainer.accelerator", "cpu",
       "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1",
       "--model.sample_bytes", "4", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
       "--monitors", "[]"]


@pytest.fixture
def lm(capfd, caplog) -> LMRun:
    return LMRun(capfd, caplog)


def _pretrained(path: Path, vocab: int = 0, tokenizer: bool = True) -> Path:
    """A tiny Llama (random weights) and, unless ``tokenizer=False``, its tokenizer, as save_pretrained writes them."""
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=vocab or len(tiny_tokenizer()), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    if tokenizer:
        save_tokenizer(path)
    return path


def _run(lm: LMRun, tmp_path: Path, *args: str) -> tuple[int, str]:
    return lm([*RUN, "--trainer.default_root_dir", str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache"),
               *args])


def _trained(tmp_path: Path):
    from recipes.text.byte_lm import ByteLM

    return ByteLM.load_from_checkpoint(tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")


def test_fine_tune_export_and_reload_the_same_model(lm, tmp_path):
    source = _pretrained(tmp_path / "llama")
    status, out = _run(lm, tmp_path, "--model.pretrained", str(source), "--model.norm", "mrs")
    assert status == 0, out
    assert "val/loss is nats per token, val/bpb bits per UTF-8 byte" in out
    exported = tmp_path / "run" / "lightning_logs" / "version_0" / "hf"
    assert (exported / "config.json").is_file() and (exported / "tokenizer.json").is_file()
    trained = _trained(tmp_path).model.eval()
    again = from_pretrained(exported).eval()
    assert isinstance(again.model.norm, MRSNorm)
    ids = torch.tensor([tiny_tokenizer().encode("def f(x):\n    return x")])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, trained(ids).logits)
    assert transformers.AutoTokenizer.from_pretrained(exported).encode("import os") == tiny_tokenizer().encode("import os")


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_the_export_command_from_a_checkpoint(lm, tmp_path, capfd):
    from recipes.export_hf import run

    source = _pretrained(tmp_path / "llama")
    status, out = _run(lm, tmp_path, "--model.pretrained", str(source), "--model.norm", "rms", "--export", "none")
    assert status == 0, out
    ckpt = tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert not (ckpt.parent.parent / "hf").exists()  # --export none
    assert run([str(ckpt), str(tmp_path / "out")]) == 0
    with torch.no_grad():
        ids = torch.tensor([[5, 7, 11, 13]])
        assert torch.equal(from_pretrained(tmp_path / "out").eval()(ids).logits, _trained(tmp_path).model.eval()(ids).logits)
    assert run([str(tmp_path / "nothing.ckpt"), str(tmp_path / "x")]) == 2
    assert "error:" in capfd.readouterr().err


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_bits_per_byte_divide_by_the_bytes_the_targets_cover(lm, tmp_path):
    """Bytes: val/bpb is val/loss / ln 2, as before. A BPE: more than one byte per token, so fewer bits per byte."""
    runs = {"bytes": ["--model.config", '{"num_hidden_layers": 1, "hidden_size": 32}'],
            "bpe": ["--model.pretrained", str(_pretrained(tmp_path / "llama"))]}
    for name, args in runs.items():
        status, out = _run(lm, tmp_path / name, *args, "--model.norm", "none")
        assert status == 0, out
        saved = torch.load(tmp_path / name / "run" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt",
                           map_location="cpu", weights_only=False)
        bpb, loss = saved["lm_val_bpb"][1], _val_loss(tmp_path / name)
        if name == "bytes":
            assert bpb == pytest.approx(loss / math.log(2), rel=1e-5)
        else:
            assert bpb < 0.8 * loss / math.log(2)  # bits per token over bytes per token


def _val_loss(root: Path) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / "run" / "lightning_logs" / "version_0"))
    events.Reload()
    return events.Scalars("val/loss")[-1].value


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_none_fine_tunes_the_model_as_it_is(lm, tmp_path):
    source = _pretrained(tmp_path / "llama")
    status, out = _run(lm, tmp_path, "--model.pretrained", str(source), "--model.norm", "none")
    assert status == 0, out
    assert type(_trained(tmp_path).model.model.norm).__name__ == "LlamaRMSNorm"


def test_a_byte_model_directory_without_a_tokenizer_reads_bytes(lm, tmp_path):
    source = _pretrained(tmp_path / "bytes", vocab=256, tokenizer=False)
    status, out = _run(lm, tmp_path, "--model.pretrained", str(source), "--model.norm", "none")
    assert status == 0, out
    assert "windows of 32 + 1 bytes" in out


@pytest.mark.parametrize("case, message", [
    ("missing", "--model.pretrained '{p}/nope/': no such directory."),
    ("not-a-model", "is a directory but not a model directory (no config.json)"),
    ("no-tokenizer", "has no tokenizer, and the recipe's bytes (256 ids) cannot feed a model with a "
                     "vocabulary of 384"),
    pytest.param("big-tokenizer", "its tokenizer has 384 tokens but the model embeds only 300", marks=pytest.mark.slow),
    ("config", "--model.config {{'hidden_size': 64}} conflicts with --model.pretrained"),
    ("arch", "--model.arch gpt2 conflicts with --model.pretrained"),
    pytest.param("offline", "is not a local directory, and HF_HUB_OFFLINE=1 is set", marks=pytest.mark.slow),
])
def test_mistakes_are_one_line(lm, tmp_path, monkeypatch, case, message):
    (tmp_path / "empty").mkdir()
    source = {"missing": lambda: f"{tmp_path}/nope/", "not-a-model": lambda: str(tmp_path / "empty"),
              "no-tokenizer": lambda: str(_pretrained(tmp_path / "m", tokenizer=False)),
              "big-tokenizer": lambda: str(_pretrained(tmp_path / "m", vocab=300)),
              "config": lambda: str(_pretrained(tmp_path / "m")), "arch": lambda: str(_pretrained(tmp_path / "m")),
              "offline": lambda: "someone/some-model"}[case]()
    extra = {"config": ["--model.config", '{"hidden_size": 64}'], "arch": ["--model.arch", "gpt2"]}.get(case, [])
    if case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    status, out = _run(lm, tmp_path, "--model.pretrained", source, *extra)
    assert status == 2
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message.format(p=tmp_path) in errors[0], out[-2000:]
    assert not (tmp_path / "run" / "lightning_logs").exists()  # nothing written that would refuse the fixed command
