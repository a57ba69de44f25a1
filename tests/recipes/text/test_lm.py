"""recipes/lm.py: fits in each precision (fp16 really fp16, with a scaler), metrics, text, mistakes."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

from helpers import ROOT
from helpers.lm import OWN_NORMS, TINY, TINY_CONFIG
from helpers.scripts import run_script
from helpers.tensorboard import event_scalars, session_start
from recipes.common.interrupt import last_checkpoint
from recipes.common.errors import UsageError

SCRIPT = ROOT / "recipes" / "lm.py"


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def _fit(args: list[str], monkeypatch: pytest.MonkeyPatch):
    from recipes.lm import build_cli

    monkeypatch.setattr(sys, "argv", ["lm.py"])
    cli = build_cli(args)
    before = {n: p.detach().clone() for n, p in cli.model.named_parameters()}
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli, before


def test_adamw_eps_that_is_zero_in_float16_is_named() -> None:
    from recipes.common.optim import eps_underflows

    embedding = nn.Embedding(256, 8)
    assert eps_underflows(torch.optim.AdamW(embedding.parameters(), eps=1e-8)) == []
    embedding.half()
    assert eps_underflows(torch.optim.AdamW(embedding.parameters(), eps=1e-8)) == [torch.float16]
    assert eps_underflows(torch.optim.AdamW(embedding.parameters(), eps=1e-4)) == []  # representable: no warning
    assert eps_underflows(torch.optim.AdamW(nn.Embedding(4, 2).bfloat16().parameters(), eps=1e-8)) == []
    # what the warning says happens: one step, three bytes in the batch, the other rows' zero gradients -> NaN
    optimizer = torch.optim.AdamW(embedding.parameters(), lr=1e-3, eps=1e-8, weight_decay=0.0)
    embedding(torch.tensor([1, 2, 3])).float().sum().backward()
    optimizer.step()
    bad = ~torch.isfinite(embedding.weight)
    assert bad[[1, 2, 3]].sum() == 0 and bad.sum() == (256 - 3) * 8


@pytest.mark.parametrize("precision, dtype", [("32-true", torch.float32), ("bf16-mixed", torch.bfloat16),
                                              ("16-mixed", torch.float16)])
def test_fit_in_each_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str,
                               dtype: torch.dtype) -> None:
    from lightning.pytorch.plugins import MixedPrecision

    cli, before = _fit([*TINY, *OWN_NORMS, "--trainer.precision", precision,
                        "--trainer.default_root_dir", str(tmp_path)], monkeypatch)
    model, trainer = cli.model, cli.trainer
    assert trainer.global_step == 3
    assert model.activation_dtype == dtype  # an activation inside the first decoder layer
    assert trainer.precision == precision and f"activations ran in {dtype}" in model.describe_precision()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # mixed precision keeps fp32 weights
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    plugin = trainer.precision_plugin
    if precision == "16-mixed":  # fp16 autocast with a loss scaler on the CPU, not Lightning's silent bf16
        assert isinstance(plugin, MixedPrecision) and plugin.device == "cpu" and plugin.precision == "16-mixed"
        scaler = plugin.scaler
        assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()
        assert 0 < scaler.get_scale() <= 2.0**16  # used: the scale tensor exists (65536 or backed off)
        saved = torch.load(Path(last_checkpoint(trainer)), weights_only=False)
        assert saved["MixedPrecision"]["scale"] == scaler.get_scale()
    else:
        assert getattr(plugin, "scaler", None) is None

    run = Path(trainer.log_dir)
    acc = _events(run)
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    for tag in ("train/loss", "train/tokens_per_s", "val/loss", "val/bpb"):
        assert tag in scalars, sorted(scalars)
    assert [s for s, _ in scalars["val/loss"]] == [1, 2]  # after step 2 and at the end (ValidateAtEnd)
    for (_, loss), (_, bpb) in zip(scalars["val/loss"], scalars["val/bpb"]):
        assert bpb == pytest.approx(loss / math.log(2), rel=1e-6)
    assert 5.0 < scalars["val/loss"][0][1] / math.log(2) < 8.5  # untrained: about log2(256) = 8 bits
    assert all(v > 0 for _, v in scalars["train/tokens_per_s"])
    # TensorBoard's HParams dashboard: the run's settings and final metrics, no empty hp_metric
    final = event_scalars(run)
    assert "hp_metric" not in final and "epoch" not in final
    assert final["z-final/val_bpb"][-1][1] == pytest.approx(scalars["val/bpb"][-1][1], rel=1e-6)
    assert final["z-final/best_val_bpb"][-1][1] == pytest.approx(min(v for _, v in scalars["val/bpb"]), rel=1e-6)
    assert final["z-final/diverged"][-1][1] == 0.0
    hparams = session_start(run)
    assert hparams["norm"].string_value == "none" and hparams["precision"].string_value == precision
    texts = acc.Tensors("samples/greedy/text_summary")
    assert [e.step for e in texts] == [2, 3]
    logged = texts[-1].tensor_proto.string_val[0].decode()
    assert logged == "\n".join("    " + line for line in (model.hparams.prompt + model.last_sample).splitlines())
    assert len(model.last_sample.encode("utf-8", errors="surrogateescape")) >= 1


def _val_bpb(trainer) -> list[float]:
    return [e.value for e in _events(Path(trainer.log_dir)).Scalars("val/bpb")]


def test_it_learns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """100 steps of the tiny model on the standard library: below the bytes' unigram entropy (4.6 bits;
    an untrained model: about 8), so it uses the context."""
    cli, _ = _fit([*TINY, *OWN_NORMS, "--trainer.max_steps", "100", "--trainer.val_check_interval", "50",
                   "--model.lr", "0.01", "--data.batch_size", "8", "--trainer.default_root_dir", str(tmp_path)],
                  monkeypatch)
    from recipes.text.corpus import unigram_entropy

    unigram = unigram_entropy(cli.datamodule.val_split.data)
    first, last = _val_bpb(cli.trainer)
    assert last < first and last < unigram - 0.2, (first, last, unigram)


@pytest.mark.parametrize("arch, config", [
    ("gpt2", {"n_layer": 2, "n_embd": 32, "n_head": 2}),  # GPT-2's own field names
    ("qwen3", {**TINY_CONFIG}),  # has QK-norms of its own
    ("gpt_neox", {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}),
])
def test_other_architectures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, config: dict) -> None:
    cli, _ = _fit([*TINY, *OWN_NORMS, "--model.arch", arch, "--model.config", json.dumps(config),
                   "--trainer.default_root_dir", str(tmp_path)], monkeypatch)
    hf = cli.model.model
    assert hf.config.model_type == arch and hf.config.vocab_size == 256 and hf.config.hidden_size == 32
    assert hf.config.num_hidden_layers == 2 and cli.trainer.global_step == 3
    assert all(math.isfinite(v) for v in _val_bpb(cli.trainer))


def test_optimizer_groups_schedule_and_clipping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cli, _ = _fit([*TINY, *OWN_NORMS, "--model.lr", "0.01", "--model.warmup_frac", "0.34",
                   "--trainer.default_root_dir", str(tmp_path)], monkeypatch)
    model, trainer = cli.model, cli.trainer
    assert trainer.gradient_clip_val == 1.0
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    by_id = {id(p): n for n, p in model.model.named_parameters()}
    no_decay = {by_id[id(p)] for p in groups["no_decay"]["params"]}
    decay = {by_id[id(p)] for p in groups["decay"]["params"]}
    modules = dict(model.model.named_modules())
    for name in no_decay | decay:
        owner = type(modules[name.rsplit(".", 1)[0]])
        expected_no_decay = issubclass(owner, nn.Embedding) or "Norm" in owner.__name__ or name.endswith("bias")
        assert (name in no_decay) == expected_no_decay, name
    assert "model.embed_tokens.weight" in no_decay and "model.layers.0.self_attn.q_proj.weight" in decay
    # 3 steps, 1 of warm-up, then cosine to 0: factors 1, 1, 0.5 (the lr of the last step taken)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 * (1 + math.cos(math.pi * 2 / 2)), abs=1e-9)


def test_command_line_end_to_end(tmp_path: Path) -> None:
    proc = run_script(SCRIPT, [*TINY, *OWN_NORMS, "--trainer.default_root_dir", str(tmp_path)], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "precision 32-true: activations ran in torch.float32" in out
    assert "data: stdlib of Python" in out and "global batch 4 windows of 32 bytes" in out
    run = tmp_path / "lightning_logs" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and list((run / "checkpoints").glob("best-*.ckpt"))
    from recipes.text.byte_lm import ByteLM

    model = ByteLM.load_from_checkpoint(run / "checkpoints" / "last.ckpt", map_location="cpu")
    assert model.model.config.hidden_size == 32 and model.model.config.vocab_size == 256
    logits = model(torch.zeros(1, 5, dtype=torch.long))  # (1, 5, 256)
    assert logits.shape == (1, 5, 256) and torch.isfinite(logits).all()


@pytest.mark.parametrize("args, expected", [
    (["--model.arch", "lama"], "error: --model.arch 'lama' is not a transformers model_type with a causal-LM head; "
                               "did you mean 'llama'"),
    (["--model.arch", "gpt-2"], "did you mean 'gpt2'"),
    (["--model.config", '{"hiden_size": 64}'], "error: --model.config: llama's config has no field 'hiden_size'; "
                                               "did you mean 'hidden_size'"),
    (["--model.norm", "batch"], "error: Parser key \"model.norm\""),
    (["--trainer.max_steps", "-1"], "error: --trainer.max_steps must be > 0, got -1"),
    (["--data.dataset", "text", "--data.path", "/nonexistent/corpus"],
     "error: --data.path /nonexistent/corpus: no such file or directory"),
    (["--ckpt_path", "/nonexistent.ckpt"], "error: --ckpt_path '/nonexistent.ckpt': no such file"),
    # inconsistent --model.config (issue 29, item 2): one line each, before any weight exists
    (["--model.config", '{"vocab_size": 100}'],
     "error: --model.config: vocab_size 100: the tokens are bytes, so the vocabulary is 256; drop vocab_size."),
    (["--model.arch", "gpt2", "--model.config", '{"max_position_embeddings": 16}'],
     "error: --model.config: gpt2's max_position_embeddings is 16, fewer than the 32 positions of a window "
     "(--data.seq_len 32)"),
    (["--model.config", '{"num_attention_heads": 3}'],
     "error: --model.config {'num_attention_heads': 3}: transformers rejects this llama config: The hidden size (128) "
     "is not a multiple of the number of attention heads (3)."),
    (["--model.config", '{"head_dim": 15}'], "transformers rejects this llama config: RoPE requires an even rotary "
                                             "dimension, but got `head_dim`=15"),
    (["--model.config", '{"head_dim": 15}', "--model.qk_norm", "mrs"], "RoPE requires an even rotary dimension"),
    (["--model.config", '{"num_key_value_heads": 3}'],
     "error: --model.config: num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (["--model.arch", "phi", "--model.qk_norm", "mrs", "--model.config",
      '{"hidden_size": 30, "num_attention_heads": 2, "rope_parameters": {"rope_type": "default", '
      '"rope_theta": 10000.0, "partial_rotary_factor": 0.4}}'],
     "error: --model.qk_norm mrs: MRSNorm pairs each head's channels into phasors, and the phi model's attention heads "
     "are 15 wide (odd)"),
    (["--monitors", "[outlier, outlier]"], "error: --monitors lists outlier more than once."),
])
def test_mistakes_are_one_line(lm_error: Callable[[list[str]], str], args: list[str], expected: str) -> None:
    line = lm_error([*TINY, *OWN_NORMS, *args])
    assert line.startswith(expected) or expected in line, line


def test_binary_file_in_the_folder_is_one_line(lm_error: Callable[[list[str]], str], tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello\n" * 100)
    (tmp_path / "b.bin").write_bytes(bytes(range(256)))
    line = lm_error([*TINY, *OWN_NORMS, "--data.dataset", "text", "--data.path", str(tmp_path)])
    assert line == (f"error: --data.path: {tmp_path / 'b.bin'} is not UTF-8 text (a binary byte at offset 0); "
                    "remove it from the folder, convert it to UTF-8, or point --data.path elsewhere.")


def test_transformers_missing_names_the_extra(lm_error: Callable[[list[str]], str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    line = lm_error(TINY)
    assert 'transformers is not installed: pip install -e ".[hf]"' in line, line


class _OddNorm(nn.Module):  # a norm layer no swap knows
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.abs().mean(-1, keepdim=True)


def test_a_swap_that_converts_nothing_is_an_error() -> None:
    from lightning_mrs import swap_norms
    from recipes.text.checks import check_swap

    model = nn.Sequential(nn.Linear(4, 4), _OddNorm(), _OddNorm())
    with pytest.raises(UsageError, match=r"--model.norm mrs: swap_norms converted none of the toy model's norm "
                                         r"layers \(_OddNorm x2; .*\); use --model.norm none"):
        check_swap(model, "toy", "mrs", "none", swap_norms(model, "mrs"))
    with pytest.raises(UsageError, match="--model.qk_norm rms: swap_norms added no QK-norm to the toy model"):
        check_swap(model, "toy", "none", "rms", swap_norms(model, None, qk_norm="rms"))
    ok = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    check_swap(ok, "toy", "rms", "none", swap_norms(ok, "rms"))  # converted one: fine


def _multi_process(tmp_path: Path, strategy: str) -> str:
    proc = run_script(SCRIPT, [*TINY, *OWN_NORMS, "--trainer.devices", "2", "--trainer.strategy", strategy,
                               "--trainer.default_root_dir", str(tmp_path)], timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "global batch 8 windows of 32 bytes = 4 per device x 2 processes" in out
    assert "fit: 3 steps in" in out
    return out


@pytest.mark.slow
def test_ddp_on_two_cpu_processes(tmp_path: Path) -> None:
    out = _multi_process(tmp_path, "ddp")
    # the export at the end of fit asks every rank for the log dir (a broadcast), then rank 0 writes
    exported = list(tmp_path.rglob("hf/config.json"))
    assert len(exported) == 1 and "export: " in out, out[-2000:]


@pytest.mark.parametrize("kind", ["mrs", "rms"])
def test_qk_norm_on_llama(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    from lightning_mrs import MRSNorm

    cli, _ = _fit([*TINY, *OWN_NORMS, "--model.qk_norm", kind, "--trainer.default_root_dir", str(tmp_path)],
                  monkeypatch)
    report = cli.model.swap_report
    expected = MRSNorm if kind == "mrs" else nn.RMSNorm
    assert sorted(report.qk_added) == sorted(f"model.layers.{i}.self_attn.{q}" for i in range(2)
                                             for q in ("q_norm", "k_norm")), report.qk_added
    modules = dict(cli.model.model.named_modules())
    assert all(isinstance(modules[name], expected) for name in report.qk_added)
    assert cli.trainer.global_step == 3


@pytest.mark.parametrize("norm", ["mrs", "rms", "layer"])
def test_norm_swap_converts_every_body_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, norm: str) -> None:
    from lightning_mrs import MRSNorm

    expected = {"mrs": MRSNorm, "rms": nn.RMSNorm, "layer": nn.LayerNorm}[norm]
    cli, _ = _fit([*TINY, "--model.norm", norm, "--trainer.precision", "16-mixed",
                   "--trainer.default_root_dir", str(tmp_path)], monkeypatch)
    hf = cli.model.model
    names = [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    names.append("model.norm")  # 2 per decoder layer and the final one
    modules = dict(hf.named_modules())
    assert all(isinstance(modules[n], expected) for n in names), {n: type(modules[n]).__name__ for n in names}
    assert not [n for n, m in modules.items() if type(m).__name__ == "LlamaRMSNorm"]
    assert sorted(cli.model.swap_report.converted + cli.model.swap_report.unchanged) == sorted(names)
    assert cli.model.activation_dtype == torch.float16 and cli.trainer.global_step == 3
    assert all(math.isfinite(v) for v in _val_bpb(cli.trainer))
    # load_from_checkpoint rebuilds the swapped model from the hyperparameters
    from recipes.text.byte_lm import ByteLM

    again = ByteLM.load_from_checkpoint(last_checkpoint(cli.trainer), map_location="cpu")
    assert isinstance(dict(again.model.named_modules())["model.norm"], expected)
    for name, tensor in again.state_dict().items():
        torch.testing.assert_close(tensor, cli.model.state_dict()[name], atol=0, rtol=0)


def test_a_swap_that_converts_nothing_is_one_line(lm_error: Callable[[list[str]], str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import recipes.text.model

    def odd_model(*args, **kwargs) -> nn.Module:
        return nn.Sequential(nn.Embedding(256, 8), _OddNorm(), nn.Linear(8, 256))

    monkeypatch.setattr(recipes.text.model, "build_causal_lm", odd_model)
    line = lm_error([*TINY, "--model.norm", "rms"])  # the swap's own "converted none" warning is not printed
    assert line.startswith("error: --model.norm rms: swap_norms converted none of the llama model's norm layers "
                           "(_OddNorm x1; "), line


def test_pure_float16_with_adamw_warns_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from recipes.lm import build_cli

    monkeypatch.setattr(sys, "argv", ["lm.py"])
    cli = build_cli([*TINY, *OWN_NORMS, "--trainer.precision", "16-true", "--trainer.max_steps", "1",
                     "--trainer.default_root_dir", str(tmp_path)])
    with pytest.warns(UserWarning, match=r"AdamW's eps=1e-08 is 0 in torch.float16, the parameters' dtype"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert all(p.dtype == torch.float16 for p in cli.model.parameters())
