"""The result file of ``benchmarks/gpu_check.py`` and how it is read: the anchors (others'
published figures) and our bar, judged on the speed rows.

``results.json`` (every figure) and ``results.md`` (one table rendered from it, the anchors and
the bar under it) in the output folder are both rewritten whole after every row by the sweeps'
``write_atomic`` (a temporary file, fsync, ``os.replace``): a run cut off at any point leaves two
readable files holding every row it finished (the JSON first: the Markdown may lag it by the
one row being written when the run was killed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recipes.sweeps.records import write_atomic  # noqa: E402 - the sweeps' atomic write (no torch)

__all__ = ["ANCHORS", "BAR_CASES", "COLUMNS", "add_row", "anchors_for", "bar", "load", "markdown", "met_text",
           "start", "update"]

#: Published figures of others, printed beside our rows (not measured here, no code of theirs):
#: (the widths they apply to, the text)
ANCHORS: list[tuple[Callable[[int], bool], str]] = [
    (lambda c: c > 4096, "QuACK RMSNorm (its own figures): ~3 TB/s, ~90 % of an H100's 3.35 TB/s, rows wider than 4K"),
    (lambda c: c == 16384, "Liger RMSNorm (its own figures) at 16384 wide: ~2.8 TB/s forward, ~0.9 TB/s backward; "
                           "torch nn.RMSNorm ~1.8 forward, ~0.6 backward"),
    (lambda c: c == 1024, "Liger RMSNorm (its own figures): backward floor near 0.3 ms at 1024 wide"),
]
#: Our bar: (case name, dtype) of the rows it is judged on; forward >= 85 % of the copy,
#: backward >= 1.0x Liger and >= 60 % of the copy
BAR_CASES = [("tokens 16384x4096", "bfloat16"), ("tokens 8192x8192", "bfloat16")]
BAR_FWD_COPY, BAR_BWD_COPY, BAR_BWD_LIGER = 0.85, 0.60, 1.0


def anchors_for(channels: int) -> list[str]:
    return [text for applies, text in ANCHORS if applies(channels)]


#: The table's columns: (key of a row, header); the speed columns empty on other rows
COLUMNS = [("group", "group"), ("check", "check"), ("status", "status"), ("seconds", "s"),
           ("fwd_gbs", "fwd GB/s"), ("fwd_copy", "fwd % copy"), ("fwd_vs_liger", "fwd x Liger"),
           ("fwd_vs_torch", "fwd x nn.RMSNorm"), ("bwd_gbs", "bwd GB/s"), ("bwd_copy", "bwd % copy"),
           ("bwd_vs_liger", "bwd x Liger"), ("bwd_vs_torch", "bwd x nn.RMSNorm"), ("result", "result")]


def load(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _save(out: Path, data: dict) -> None:
    write_atomic(out / "results.json", json.dumps(data, indent=1))
    write_atomic(out / "results.md", markdown(data))


def start(out: Path, meta: dict) -> None:
    """A fresh result file: ``meta`` (title, missing lines, estimates), no rows yet."""
    out.mkdir(parents=True, exist_ok=True)
    _save(out, {"meta": meta, "rows": [], "summary": {}})


def add_row(out: Path, row: dict) -> None:
    """Append ``row`` (group, check, status, seconds, result; the speed columns; ``index``)."""
    data = load(out)
    data["rows"].append(row)
    _save(out, data)


def update(out: Path, **summary: object) -> None:
    """Set entries of the summary (the core's measured seconds, the extended part's fate)."""
    data = load(out)
    data["summary"].update(summary)
    _save(out, data)


def _cell(key: str, value: object) -> str:
    if value is None:
        return ""
    if key.endswith("_copy"):
        return f"{value:.0%}"
    if key.endswith(("_liger", "_torch")):
        return f"x{value:.2f}"
    if isinstance(value, float):
        return f"{value:.4g}" if key != "seconds" else f"{value:.1f}"
    return str(value).replace("|", "/").replace("\n", " ")


def markdown(data: dict) -> str:
    """The file as Markdown: the title, what is missing, the anchors, the table, the bar, the summary."""
    meta, rows, summary = data["meta"], data["rows"], data["summary"]
    lines = [f"# {meta.get('title', 'gpu_check')}", ""]
    lines += [f"- {line}" for line in meta.get("missing", [])] + ([""] if meta.get("missing") else [])
    lines += ["Anchors (their own published figures, not measured here):", ""]
    lines += [f"- {text}" for _, text in ANCHORS] + [""]
    lines += ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(k, r.get(k)) for k, _ in COLUMNS) + " |" for r in rows]
    lines += ["", "Our bar:", ""]
    lines += [f"- {claim}: {met_text(met)} ({shown})" for claim, met, shown in bar(rows)]
    if summary:
        lines += ["", "Summary:", ""] + [f"- {k}: {v}" for k, v in summary.items()]
    return "\n".join(lines) + "\n"


def met_text(met: Optional[bool]) -> str:
    return "unknown" if met is None else ("met" if met else "NOT met")


def bar(rows: list[dict]) -> list[tuple[str, Optional[bool], str]]:
    """Our bar against the speed rows of the result file: ``(claim, met, evidence)``, ``met``
    ``None`` where the row or its Liger figure is missing."""
    out = []
    for case, dtype in BAR_CASES:
        row = next((r for r in rows if r["group"] == "speed" and r["check"] == f"{case} {dtype}"
                    and r.get("fwd_gbs") is not None), None)
        for claim, key, floor in ((f"forward >= {BAR_FWD_COPY:.0%} of the copy", "fwd_copy", BAR_FWD_COPY),
                                  (f"backward >= {BAR_BWD_LIGER:.1f}x Liger", "bwd_vs_liger", BAR_BWD_LIGER),
                                  (f"backward >= {BAR_BWD_COPY:.0%} of the copy", "bwd_copy", BAR_BWD_COPY)):
            value = None if row is None else row.get(key)
            shown = "not measured" if value is None else (f"{value:.0%}" if "copy" in key else f"x{value:.2f}")
            out.append((f"{claim} on {case} {dtype}", None if value is None else value >= floor, shown))
    return out
