"""The LM sweeps' mistakes in the sweep's own option names (issue 29 item 6), as docs/recipes.md promises."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from recipes.sweeps.runner import run


@pytest.mark.parametrize("argv, expected", [
    (["--arch-kwargs", '{"hiden_size": 64}'],
     "error: --arch-kwargs: llama's config has no field 'hiden_size'; did you mean 'hidden_size'"),
    (["--arch-kwargs", '{"max_position_embeddings": 16}'],
     "error: --arch-kwargs: llama's max_position_embeddings is 16, fewer than the 64 positions of a window ("
     "--seq-len 64): raise it or drop it (it defaults to --seq-len)."),
    ("small folder", "error: --seq-len 64 needs at least 65 bytes in each split, but {root} (2 files, "
                     "16 bytes) gives training 4 and validation 12 bytes: add text to --path."),
])
def test_lm_sweep_mistakes_name_the_sweeps_options(tmp_path: Path, argv: list[str] | str, expected: str,
                                                   capsys: pytest.CaptureFixture,
                                                   error_line: Callable[[int, str], str]) -> None:
    if argv == "small folder":
        root = tmp_path / "text"
        root.mkdir()
        (root / "a.txt").write_text("hello world\n")
        (root / "b.txt").write_text("abc\n")
        argv, expected = ["--dataset", "text", "--path", str(root)], expected.format(root=root)
    out = tmp_path / "sweep"
    status = run(["--sweep", "lm", "--quick", *argv, "--out", str(out)])
    line = error_line(status, capsys.readouterr().err)
    assert line == expected or line.startswith(expected), line
    assert "--model." not in line and "--data." not in line  # recipes/lm.py's names, which stress.py does not take
    assert not out.exists()  # nothing written: the corrected command starts clean


def test_the_text_is_path_as_in_lm_py(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from recipes.stress import parse_args

    text = tmp_path / "corpus.txt"
    text.write_text("hello\n")
    args = parse_args(["--sweep", "lm", "--dataset", "text", "--path", str(text)])
    assert args.root == str(text) and capsys.readouterr().err == ""
    for argv, message in ((["--dataset", "text", "--root", str(text)], "--dataset text reads its text from --path"),
                          (["--dataset", "text"], "--dataset text needs --path FILE_OR_DIR"),
                          (["--dataset", "stdlib", "--path", "a"], "--path is the text of --dataset text")):
        with pytest.raises(SystemExit):
            parse_args(["--sweep", "lm", *argv])
        assert message in capsys.readouterr().err
