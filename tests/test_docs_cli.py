"""docs/cli.md stays true: every ``$ fxinit ...`` line of its examples is run (in a directory
holding the graph its first ``bash`` block traces and ``docs/examples/my_models.py``) and must
print what the page shows under it (``...`` stands for any text, alone on a line for any lines:
the convention of ``tests/test_demo.py``)."""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
from pathlib import Path

import pytest

from fxinit.cli import main
from tests.test_demo import assert_printed

ROOT = Path(__file__).resolve().parent.parent
CLI_DOC = ROOT / "docs" / "cli.md"


def _command(lines: list[str]) -> tuple[list[str], int]:
    """The argv of the shell command that starts ``lines`` (continued by ``\\`` or inside an
    open quote), and how many lines it takes."""
    text = ""
    for n, line in enumerate(lines, 1):
        text += line.rstrip().removesuffix("\\") + ("\n" if line.rstrip().endswith("\\") else " ")
        if line.rstrip().endswith("\\"):
            continue
        try:
            return shlex.split(text), n
        except ValueError:  # an open quote: the command goes on
            continue
    raise AssertionError(f"unterminated command in {CLI_DOC.name}: {lines[0]}")


def code_blocks(doc: Path) -> list[tuple[str, list[str]]]:
    """``(language, lines)`` of each fenced code block of ``doc``."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
                blocks.append((line[3:].strip(), current))
            else:
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def sessions(doc: Path) -> list[tuple[list[str], list[str]]]:
    """``(argv, printed lines)`` of each ``$ fxinit`` line of the page's plain code blocks."""
    out = []
    for language, block in code_blocks(doc):
        if language:
            continue
        lines = list(block)
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ fxinit"):
                i += 1
                continue
            lines[i] = lines[i][2:]
            argv, n = _command(lines[i:])
            i += n
            printed = []
            while i < len(lines) and not lines[i].startswith("$ "):
                printed.append(lines[i])
                i += 1
            out.append((argv, printed))
    return out


def _traced_graph(directory: Path) -> None:
    block = next(lines for language, lines in code_blocks(CLI_DOC) if language == "bash")
    argv, _ = _command(block)
    assert argv[:2] == ["fxinit", "trace"] and "llama.pt" in argv, "docs/cli.md's first bash block traces llama.pt"
    assert main(argv[1:]) == 0


def test_the_page_has_sessions() -> None:
    commands = [argv[1] for argv, _ in sessions(CLI_DOC)]
    assert {"check", "show"} <= set(commands)


@pytest.mark.parametrize("i", range(len(sessions(CLI_DOC))))
def test_cli_page_prints_what_it_shows(i: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv, printed = sessions(CLI_DOC)[i]
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "docs" / "examples" / "my_models.py", tmp_path)
    if "llama.pt" in argv:
        _traced_graph(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        main(argv[1:])
    block = "print()\n" + "".join(f"# {line}\n" for line in printed)
    assert_printed(block, out.getvalue(), f"docs/cli.md: $ {shlex.join(argv)}")
