"""recipes/stress.py --sweep qk: a tiny transformer sweep end to end, its options, its claims and summaries."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import ROOT
from helpers.scripts import results_rows, run_script
from recipes import stress
from recipes.stress import parse_args
from recipes.sweeps.claims import engine as sc
from recipes.sweeps.kinds.qk import HIGH_LR_MIN, QK, claims, figure as qk_figure
from recipes.sweeps.records import Row, read_csv
from recipes.sweeps.robustness import robustness

TINY = ["--sweep", "qk", "--dataset", "digits", "--qk-norms", "none", "mrs", "--lrs", "0.03", "--batch-sizes", "16",
        "--max-steps", "3", "--log-every", "1", "--seeds", "0", "--jobs", "1", "--mrs-backend", "eager"]


def test_tiny_qk_sweep_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "qk"
    proc = run_script(ROOT / "recipes" / "stress.py", [*TINY, "--out", str(out)], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 to run (in this process)" in proc.stdout and "max attention logit" in proc.stdout
    raw = results_rows(out)
    assert [(r["qk_norm"], r["lr"], r["batch_size"], r["seed"]) for r in raw] == [
        ("none", "0.03", "16", "0"), ("mrs", "0.03", "16", "0")]
    tokens = (QK.datasets["digits"]["image_size"] // QK.datasets["digits"]["arch_kwargs"]["patch_size"]) ** 2 + 1
    for r in raw:
        assert "norm" not in r and r["steps"] == "3" and r["diverged"] == "0"
        assert 0 < float(r["max_logit"]) < 1e4
        assert 0 <= float(r["min_entropy"]) <= math.log(tokens) + 1e-4  # at most uniform over the keys
        assert 0 <= float(r["max_collapsed_frac"]) <= 1 and math.isfinite(float(r["mean_grad_cv"]))
        assert (out / r["tb_run"]).name == f"qk-{r['qk_norm']}_lr0.03_bs16_seed0"
    md = (out / "results.md").read_text()
    assert md.startswith("# QK-norm stress sweep (digits)")
    assert "- sweep: `qk`" in md and "optimizer: `AdamW" in md and "warmup_frac: `0.05`" in md
    assert "| lr | batch | qk_norm | seeds | final top-1 | best top-1 | divergence | max logit |" in md
    assert "| 0.03 | 16 | none | 1 |" in md and "| 0.03 | 16 | mrs | 1 |" in md
    # one seed: nothing can be decided, and each claim says why
    assert md.count("| inconclusive |") == len(claims([])) and "P1: MRS QK-norm prevents attention-logit growth" in md
    assert "## Learning-rate robustness" in md and "| qk_norm | batch 16 |" in md
    assert (out / "robustness.csv").read_text().startswith("qk_norm,batch_size,")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the figure: top-1 and max attention logit (log scale) against lr, one line per QK-norm
    rows = read_csv(out / "results.csv", QK.arm_column, QK.metric_columns)
    (top, logit), = qk_figure(rows, tmp_path / "again.png")
    assert "top-1" in top.get_title() and "attention logit" in logit.get_title() and logit.get_yscale() == "log"
    for ax, key, scale in ((top, "final_top1", 100), (logit, "max_logit", 1)):
        lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines() if line.get_label()[0] != "_"}
        assert lines == {r.arm: [pytest.approx(scale * r.value(key, QK.arm_column), rel=1e-5)] for r in rows}


def _row(qk: str, lr: float, seed: int, logit: float, entropy: float, top1: float, diverged: bool = False) -> Row:
    return Row(qk, lr, 64, seed, num_classes=10, final_top1=top1, diverged=diverged,
               divergence_step=5 if diverged else None, planned_steps=100,
               metrics={"max_logit": logit, "min_entropy": entropy})


def _table(mrs_logit: Callable[[float], float] = lambda lr: 5.0, diverged_none_at: float = -1.0
           ) -> list[Row]:
    """none: logits grow 10x per decade of lr, entropy and accuracy fall; layer and mrs stay bounded."""
    rows = []
    for lr in (0.001, 0.01, 0.1):
        decade = round(math.log10(lr / 0.001))
        for seed in range(3):
            jitter = 1 + 0.05 * seed
            rows.append(_row("none", lr, seed, 3 * 10**decade * jitter, 2.0 / (1 + 3 * decade) * jitter,
                             0.9 - 0.35 * decade + 0.01 * seed, diverged=lr == diverged_none_at and seed < 2))
            rows.append(_row("layer", lr, seed, 4 * jitter, 1.8 * jitter, 0.9 - 0.05 * decade + 0.01 * seed))
            rows.append(_row("mrs", lr, seed, mrs_logit(lr) * jitter, 2.1 * jitter, 0.9 - 0.04 * decade + 0.01 * seed))
    return rows


def _verdicts(rows: list[Row]) -> dict[str, sc.Claim]:
    return {c.key: sc.evaluate(c) for c in claims(rows)}


def test_qk_claims_supported_when_only_none_grows() -> None:
    rows = _table()
    verdicts = _verdicts(rows)
    assert {k: c.verdict for k, c in verdicts.items()} == {k: "supported" for k in ("0", "W1", "W2", "P1", "P2", "P3")}
    # P1 compares log10 logits of mrs and none at every high lr (0.01, 0.1), nothing else
    outcomes = [o for _, group in verdicts["P1"].outcomes for o in group]
    assert [o.comparison.label for o in outcomes] == ["lr 0.01, batch 64: mrs - none", "lr 0.1, batch 64: mrs - none"]
    def log_mean(qk: str) -> float:
        return statistics.fmean(math.log10(r.metrics["max_logit"]) for r in rows if r.arm == qk and r.lr == 0.1)

    assert outcomes[1].interval.estimate == pytest.approx(log_mean("mrs") - log_mean("none"))
    assert HIGH_LR_MIN == 0.01  # the definition the report states


def test_qk_claims_contradicted_when_mrs_logits_grow_too() -> None:
    verdicts = _verdicts(_table(mrs_logit=lambda lr: 3 * (lr / 0.001) * 2))  # twice none's logits
    assert verdicts["P1"].verdict == "contradicted" and verdicts["W1"].verdict == "supported"


def test_diverged_seeds_leave_logit_comparisons_out() -> None:
    """Two of three `none` seeds diverge at lr 0.1: its logit comparisons there cannot be measured."""
    verdicts = _verdicts(_table(diverged_none_at=0.1))
    outcomes = {o.comparison.label: o for _, group in verdicts["P1"].outcomes for o in group}
    assert outcomes["lr 0.1, batch 64: mrs - none"].excluded
    assert not outcomes["lr 0.01, batch 64: mrs - none"].excluded
    assert verdicts["P1"].verdict == "supported" and "1 not measurable, left out" in verdicts["P1"].why


def test_lr_sensitivity_per_qk_norm() -> None:
    """The robustness summary by QK-norm: the shared one, on the kind's arm."""
    by_qk = {s.arm: s for s in robustness(_table())}
    assert by_qk.keys() == {"none", "layer", "mrs"}
    # by hand for none, seed 0: accuracies 0.9, 0.55, 0.2 -> mean gap to the best (0.9) = (0 + 0.35 + 0.7) / 3
    assert by_qk["none"].per_seed_sensitivity[0] == pytest.approx(0.35)
    # layer, seed 1: 0.91, 0.86, 0.81 -> (0 + 0.05 + 0.1) / 3
    assert by_qk["layer"].per_seed_sensitivity[1] == pytest.approx(0.05)


def test_qk_defaults_and_help(capsys: pytest.CaptureFixture) -> None:
    args = parse_args(["--sweep", "qk", "--dataset", "digits"])
    digits = QK.datasets["digits"]
    assert args.sweep is QK and args.qk_norms == args.arms == QK.grid["arms"]
    assert (args.lrs, args.batch_sizes, args.seeds) == (QK.grid["lrs"], QK.grid["batch_sizes"], QK.grid["seeds"])
    assert (args.arch, args.arch_kwargs, args.image_size, args.augment, args.epochs) == (
        digits["arch"], digits["arch_kwargs"], digits["image_size"], digits["augment"], digits["epochs"])
    assert (args.weight_decay, args.warmup_frac, args.out) == (QK.weight_decay, QK.warmup_frac,
                                                               str(Path("runs") / "stress_qk_digits"))
    quick = parse_args(["--sweep", "qk", "--dataset", "digits", "--quick"])
    assert (quick.lrs, quick.seeds, quick.epochs) == (QK.quick["lrs"], QK.quick["seeds"], QK.quick["epochs"]["digits"])
    with pytest.raises(SystemExit):
        parse_args(["--sweep", "qk", "--help"])  # the help states the asked kind's defaults
    text = " ".join(capsys.readouterr().out.split())
    listed = lambda values: " ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)  # noqa: E731
    assert f"peak learning rates (default: {listed(QK.grid['lrs'])} (--quick: {listed(QK.quick['lrs'])}))" in text
    doc = " ".join(stress.__doc__.replace("#", " ").split())  # the module docstring states the same defaults
    assert f"QK-norms {listed(QK.grid['arms'])}; lrs {listed(QK.grid['lrs'])}; batch size " \
           f"{listed(QK.grid['batch_sizes'])}; seeds {listed(QK.grid['seeds'])}; {digits['epochs']} epochs" in doc
    assert f"--quick: one seed, lrs {listed(QK.quick['lrs'])}, {QK.quick['epochs']['digits']} epochs" in doc
    assert f"{100 * QK.warmup_frac:g} % warm-up" in doc


@pytest.mark.parametrize("argv,message", [
    (["--sweep", "qk", "--norms", "mrs"], "--norms is an option of --sweep norm; --sweep qk varies --qk-norms"),
    (["--qk-norms", "mrs"], "--qk-norms is an option of --sweep qk"),
    (["--sweep", "qk", "--qk-norms", "l2"], "--qk-norms: invalid choice: 'l2'"),
    (["--sweep", "qk", "--lrs", "0"], "argument --lrs: must be > 0, got 0"),
    (["--sweep", "qk", "--warmup-frac", "1"], "argument --warmup-frac: must be in [0, 1), got 1"),
    (["--sweep", "qk", "--image-size", "16", "--arch-kwargs", '{"img_size": 8}'],
     "--image-size 16 does not fit the model's img_size 8"),
])
def test_bad_qk_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture,
                          error_line: Callable[[int, str], str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--dataset", "digits", *argv])
    assert message in error_line(exit_.value.code, capsys.readouterr().err)
