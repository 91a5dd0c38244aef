"""The built-in example and the user guide stay true: both are run as written."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
from pathlib import Path

import pytest
import torch

import fxinit.demo

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide.md"


def test_demo_is_bitwise_equal_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "drawing"
    assert fxinit.demo.main(["--out", str(out), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "RESULT: bit-for-bit equal to eager construction" in printed
    assert "lm_head.weight" in printed and "tied to embed.weight" in printed
    assert "(uniform_ [kaiming_uniform_]: dead) -> normal_" in printed  # recipes come from the init graph
    source = (out / "init_deps.dot").read_text()
    assert "cluster_layers.0.attn" in source and "inv_freq" in source
    if shutil.which("dot"):
        assert (out / "init_deps.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def test_demo_without_graphviz_binary_writes_dot(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no `dot` to be found
    assert fxinit.demo.main(["--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "init_deps.dot" in printed and not (tmp_path / "init_deps.svg").exists()
    assert (tmp_path / "init_deps.dot").read_text().startswith("digraph")


def python_blocks(doc: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.S | re.M)


def printed_outputs(block: str) -> list[list[str]]:
    """The outputs a block says it prints: the ``# `` comment lines right after a line that
    calls ``print(``, one group per such line (the docs' convention; ``...`` stands for any
    text, alone on a line for any lines)."""
    groups: list[list[str]] = []
    lines = block.splitlines()
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("print("):
            continue
        group = []
        for after in lines[i + 1:]:
            if not after.lstrip().startswith("# "):
                break
            group.append(after.lstrip()[2:].rstrip())
        if group:
            groups.append(group)
    return groups


def _pattern(group: list[str]) -> str:
    parts = []
    for line in group:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.split("...")) + r"[ \t]*\n")
    return "".join(parts)


def assert_printed(block: str, out: str, where: str) -> None:
    """Each printed group appears in ``out``, in order, each as whole lines."""
    pos = 0
    for group in printed_outputs(block):
        match = re.compile(r"^" + _pattern(group), re.M).search(out, pos)
        assert match, f"{where}: the doc says it prints\n" + "\n".join(group) + f"\nbut it printed\n{out[pos:]}"
        pos = match.end()


def run_blocks(doc: Path) -> None:
    """Every ```python block of ``doc``, in order, in one namespace; what each prints must
    be what the block's comments say (``printed_outputs``)."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    rng = torch.get_rng_state()
    try:
        for i, block in enumerate(python_blocks(doc)):
            where = f"{doc.relative_to(ROOT)}[python block {i + 1}]"
            code = compile(block, where, "exec")
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(code, namespace)  # noqa: S102 - the docs are ours
            assert_printed(block, out.getvalue(), where)
    finally:
        torch.set_rng_state(rng)
        fxinit.clear_meta_init_cache()


def test_printed_output_convention_catches_drift() -> None:
    block = 'print("plan: 4 nodes in 2 groups")\n# plan: 5 nodes in ... groups\n'
    with pytest.raises(AssertionError, match="the doc says it prints"):
        assert_printed(block, "plan: 4 nodes in 2 groups\n", "example")
    assert_printed(block.replace("5", "4"), "plan: 4 nodes in 2 groups\n", "example")
    assert_printed('print(t)\n# a\n# ...\n# z\n', "a\nb\nc\nz\n", "example")


def test_guide_has_examples() -> None:
    assert len(python_blocks(GUIDE)) >= 10


def test_every_python_block_of_the_guide_runs() -> None:
    run_blocks(GUIDE)


def test_readme_usage_runs() -> None:
    assert len(python_blocks(ROOT / "README.md")) == 1
    run_blocks(ROOT / "README.md")
