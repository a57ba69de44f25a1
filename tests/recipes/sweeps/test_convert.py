"""recipes/stress.py --sweep convert: a tiny sweep end to end against independent evaluations of the swapped model,
the cached base model, the claims and the rebuild from the CSV files, the user's own checkpoint, and the mistakes."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from helpers.scripts import results_rows
from recipes.stress import parse_args
from recipes.sweeps.claims.engine import evaluate
from recipes.sweeps.kinds.convert import CONVERT, eval_steps
from recipes.sweeps.rebuild import rebuild
from recipes.sweeps.runner import run

TINY_CONFIG = '{"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, ' \
              '"intermediate_size": 32}'
TINY = ["--sweep", "convert", "--seeds", "0", "1", "--max-steps", "4", "--base-steps", "10", "--jobs", "1",
        "--mrs-backend", "eager"]


@pytest.fixture(autouse=True)
def _one_thread_and_a_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("LIGHTNING_MRS_CACHE", str(tmp_path / "cache"))
    yield
    torch.set_num_threads(threads)


def _cells(out: Path) -> dict[tuple[str, int], dict]:
    return {(r["arm"], r["seed"]): r for r in map(json.loads, map(Path.read_text, (out / "cells").glob("*.json")))}


def _text(tmp_path: Path) -> list[str]:
    """``--dataset text --path DIR``: a few standard-library files (quicker to read than the whole library)."""
    from helpers.tokenizers import STDLIB_SAMPLE

    text = tmp_path / "text"
    if not text.exists():
        text.mkdir()
        for name in STDLIB_SAMPLE:
            (text / Path(name).name).write_text(Path(name).read_text())
    return ["--dataset", "text", "--path", str(text)]


def _direct_bpb(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Bits per byte of a byte model on ``windows`` ``(W, T + 1)``, straight from its logits (float64 mean)."""
    with torch.no_grad():
        logits = model.eval()(input_ids=windows[:, :-1]).logits  # (W, T, 256)
    nats = F.cross_entropy(logits.double().flatten(0, 1), windows[:, 1:].flatten())
    return float(nats) / math.log(2)


@pytest.mark.slow  # about 40 s on 2 shared cores; test_the_control_and_inherit_against_direct_evaluations is the quick one
def test_tiny_convert_sweep_arms_cache_claims_and_rebuild(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_mrs import swap_norms
    from recipes.sweeps.cells.convert import new_model
    from recipes.sweeps.cells.convert import datamodule

    out = tmp_path / "convert"
    argv = [*TINY, "--arch-kwargs", TINY_CONFIG, *_text(tmp_path), "--out", str(out)]
    assert run(argv) == 0, capsys.readouterr().err
    cells = _cells(out)
    assert {arm for arm, _ in cells} == set(CONVERT.arms) and len(cells) == 8
    assert sum(c["base_trained"] for c in cells.values()) == 2  # one base model per seed, then the cache
    for seed in (0, 1):
        go, inherit, calibrated, rms = (cells[(a, seed)] for a in CONVERT.arms)
        assert go["bpb_step0"] == go["base_bpb"] and go["converted"] == 0  # continue: the base model itself
        assert {c["base_bpb"] for c in (rms, inherit, calibrated)} == {go["base_bpb"]}  # the same base weights
        assert rms["converted"] == inherit["converted"] == 3  # the Llama's 3 RMSNorms of one layer and the final
        assert rms["bpb_step0"] == pytest.approx(go["bpb_step0"], abs=1e-6)  # RMSNorm -> RMSNorm: exact
        assert rms["final_bpb"] == pytest.approx(go["final_bpb"], abs=1e-4)
        assert inherit["bpb_step0"] > go["bpb_step0"] + 1e-3  # the swap changes what the trained model computes
        assert calibrated["calib_err_fitted"] < calibrated["calib_err_inherit"]
        assert abs(calibrated["bpb_step0"] - go["bpb_step0"]) < abs(inherit["bpb_step0"] - go["bpb_step0"])
        assert [p["step"] for p in inherit["healing"]] == eval_steps(4) == [0, 1, 2, 4]

    # inherit's step-0 bpb is the swapped model's own bpb on the validation windows, computed from its logits
    args = parse_args(argv)
    dm = datamodule(args, 1)
    dm.load()
    windows = torch.stack([dm.val_set[i] for i in range(len(dm.val_set))]).long()  # (W, T + 1)
    lm = new_model(args, 1e-3, 0.0, "cosine")
    lm.model.load_state_dict(torch.load(cells[("mrs-inherit", 0)]["base_cache"], weights_only=True))
    assert _direct_bpb(lm.model, windows) == pytest.approx(cells[("continue", 0)]["bpb_step0"], rel=1e-6)
    swap_norms(lm.model, "mrs", init="inherit")
    assert _direct_bpb(lm.model, windows) == pytest.approx(cells[("mrs-inherit", 0)]["bpb_step0"], rel=1e-6)

    # the claims from the CSV alone; the report and the rebuild from the CSV files
    claims = {c.key: evaluate(c) for c in CONVERT.claims(CONVERT.read(out / "results.csv"))}
    assert set(claims) == {"C", "S-inherit", "S-calibrate", "H-inherit", "H-calibrate", "B0", "BK"}
    assert claims["C"].verdict == "supported"  # four comparisons, each of an exact swap
    md = (out / "results.md").read_text()
    assert md.startswith("# Conversion cost: RMSNorm -> MRSNorm on a trained model (text)")
    assert "| C: The control: an RMSNorm -> RMSNorm swap costs nothing | **supported** |" in md
    assert "## Healing (val bpb along the healing steps)" in md and "| mrs-inherit | +" in md
    assert "## Learning-rate robustness" not in md  # one lr
    healing = list(csv.DictReader(open(out / "healing.csv")))
    assert len(healing) == 8 * 4 and (out / "healing.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    rebuilt = rebuild("convert", out / "results.csv", out / "results.md", tmp_path / "rebuilt")
    assert (rebuilt / "results.md").read_text() == md
    assert (rebuilt / "healing.csv").read_text() == (out / "healing.csv").read_text()

    # another sweep with the same base settings loads the cached base models: nothing retrained
    again = tmp_path / "again"
    assert run([*TINY, "--arch-kwargs", TINY_CONFIG, *_text(tmp_path), "--convert-arms", "continue", "--out",
                str(again)]) == 0
    reused = _cells(again)
    assert not any(c["base_trained"] for c in reused.values())
    assert {s: c["bpb_step0"] for (_, s), c in reused.items()} == {s: cells[("continue", s)]["bpb_step0"]
                                                                    for s in (0, 1)}


def test_the_control_and_inherit_against_direct_evaluations(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The quick one: continue, rms and mrs-inherit for one seed, 2 healing steps, then the cache is reused."""
    from lightning_mrs import swap_norms
    from recipes.sweeps.cells.convert import datamodule, new_model

    out = tmp_path / "quick"
    common = ["--sweep", "convert", "--seeds", "0", "--max-steps", "2", "--base-steps", "10", "--jobs", "1",
              "--mrs-backend", "eager", "--arch-kwargs", TINY_CONFIG, *_text(tmp_path)]
    argv = [*common, "--convert-arms", "continue", "rms", "mrs-inherit", "--out", str(out)]
    assert run(argv) == 0, capsys.readouterr().err
    cells = _cells(out)
    go, rms, inherit = (cells[(a, 0)] for a in ("continue", "rms", "mrs-inherit"))
    assert [c["base_trained"] for c in (go, rms, inherit)] == [True, False, False]
    assert rms["bpb_step0"] == pytest.approx(go["bpb_step0"], abs=1e-6) and rms["converted"] == 3
    assert inherit["bpb_step0"] > go["bpb_step0"] + 1e-3
    args = parse_args(argv)
    dm = datamodule(args, 1)
    dm.load()
    windows = torch.stack([dm.val_set[i] for i in range(len(dm.val_set))]).long()  # (W, T + 1)
    lm = new_model(args, 1e-3, 0.0, "cosine")
    lm.model.load_state_dict(torch.load(inherit["base_cache"], weights_only=True))
    swap_norms(lm.model, "mrs", init="inherit")
    assert _direct_bpb(lm.model, windows) == pytest.approx(inherit["bpb_step0"], rel=1e-6)
    again = tmp_path / "again"
    assert run([*common, "--convert-arms", "continue", "--out", str(again)]) == 0
    assert _cells(again)[("continue", 0)]["base_trained"] is False  # the cached base model, not retrained


def _pretrained(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    from helpers.tokenizers import save_tokenizer, tiny_tokenizer

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=len(tiny_tokenizer()), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return save_tokenizer(path)


@pytest.mark.slow  # idle 2 cores: 10-45 s; the default suite keeps a faster sibling
def test_convert_on_your_own_checkpoint_and_text(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source = _pretrained(tmp_path / "llama")
    out = tmp_path / "out"
    argv = ["--sweep", "convert", "--pretrained", str(source), *_text(tmp_path), "--seq-len", "32", "--seeds", "0", "--max-steps", "1", "--convert-arms", "continue", "mrs-calibrate", "--out",
            str(out)]
    assert run(argv) == 0, capsys.readouterr().err
    cells = _cells(out)
    assert not any(c["base_trained"] for c in cells.values()) and len(cells) == 2
    assert cells[("continue", 0)]["base_bpb"] == cells[("mrs-calibrate", 0)]["base_bpb"]  # the checkpoint, unswapped
    for c in cells.values():  # bits per byte, below the bits per token of a tokenizer of more than a byte per token
        assert 0 < c["final_bpb"] < c["final_val_loss"] / math.log(2)
    assert all(math.isfinite(c["final_bpb"]) and c["dataset"] == "text" for c in cells.values())
    settings = json.loads((out / "settings.json").read_text())
    assert settings["seq_len"] == 32 and settings["base_model"].startswith(f"--pretrained {source}")
    assert "; base model: --pretrained" in (out / "results.md").read_text()
    progress = capsys.readouterr()
    assert progress.out.count(f"base model --pretrained {source}") + progress.err.count(
        f"base model --pretrained {source}") == 2 and "from the cache" not in progress.out + progress.err


def test_the_setup_of_a_pretrained_sweep_gives_the_checkpoints_sizes(tmp_path: Path) -> None:
    from recipes.sweeps.kinds.convert import progress_note
    from recipes.sweeps.settings import sweep_settings

    source = _pretrained(tmp_path / "llama")
    settings = sweep_settings(parse_args(["--sweep", "convert", "--pretrained", str(source), *_text(tmp_path)]))
    assert settings["arch"] == "llama"
    assert settings["arch_kwargs"] == {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "num_key_value_heads": 2, "intermediate_size": 32}  # _pretrained's config
    assert progress_note({"base_pretrained": str(source), "base_trained": False}) == f", base model --pretrained {source}"
    assert progress_note({"base_pretrained": None, "base_trained": False}) == ", base model from the cache"


@pytest.mark.parametrize("argv, message", [
    (["--pretrained", "/nonexistent/model"], "--pretrained '/nonexistent/model': no such directory."),
    (["--dataset", "text"], "--dataset text needs --path FILE_OR_DIR"),
    (["--pretrained", "x/", "--base-steps", "5"], "--base-steps trains the sweep's own base model; with --pretrained"),
    (["--pretrained", "x/", "--arch-kwargs", "{}"], "--arch-kwargs conflicts with --pretrained 'x/'"),
    (["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
])
def test_convert_mistakes_are_one_line(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture,
                                       error_line: Callable[[int, str], str]) -> None:
    try:  # a command-line mistake exits in the parser, one in the model or the data when the cells are checked
        status = run(["--sweep", "convert", *argv, "--out", str(tmp_path / "never")])
    except SystemExit as exit_:
        status = exit_.code
    assert message in error_line(status, capsys.readouterr().err)
    assert not (tmp_path / "never").exists()


def test_a_directory_that_is_not_a_model(tmp_path: Path, capsys: pytest.CaptureFixture,
                                         error_line: Callable[[int, str], str]) -> None:
    status = run(["--sweep", "convert", "--pretrained", str(tmp_path), "--out", str(tmp_path / "never")])
    assert "is a directory but not a model directory (no config.json)" in error_line(status, capsys.readouterr().err)


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "lm", "--pretrained", "x/"], "--pretrained is an option of --sweep convert"),
    (["--sweep", "norm", "--seq-len", "32"], "--seq-len is an option of --sweep lm and --sweep lm-qk and --sweep "
                                             "convert"),
    (["--sweep", "qk", "--base-steps", "3"], "--base-steps is an option of --sweep convert"),
])
def test_the_options_of_other_kinds(argv: list[str], message: str, capsys: pytest.CaptureFixture,
                                    error_line: Callable[[int, str], str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert message in error_line(exit_.value.code, capsys.readouterr().err)


def test_the_lm_sweeps_take_a_sequence_length() -> None:
    from recipes.sweeps import settings

    args = parse_args(["--sweep", "lm-qk", "--seq-len", "32"])
    assert args.seq_len == 32 and settings.sweep_settings(args)["seq_len"] == 32
    assert parse_args(["--sweep", "lm"]).seq_len == 64 and parse_args(["--sweep", "convert"]).base_steps == 600
    assert parse_args(["--dataset", "digits"]).seq_len is None  # an image sweep has none
