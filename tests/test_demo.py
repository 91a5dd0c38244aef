"""The built-in example and the user guide stay true: both are run as written."""

from __future__ import annotations

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


def run_blocks(doc: Path) -> None:
    """Every ```python block of ``doc``, in order, in one namespace."""
    namespace: dict[str, object] = {"__name__": doc.stem}
    rng = torch.get_rng_state()
    try:
        for i, block in enumerate(python_blocks(doc)):
            code = compile(block, f"{doc.relative_to(ROOT)}[python block {i + 1}]", "exec")
            exec(code, namespace)  # noqa: S102 - the docs are ours
    finally:
        torch.set_rng_state(rng)
        fxinit.clear_meta_init_cache()


def test_guide_has_examples() -> None:
    assert len(python_blocks(GUIDE)) >= 10


def test_every_python_block_of_the_guide_runs() -> None:
    run_blocks(GUIDE)


def test_readme_usage_runs() -> None:
    assert len(python_blocks(ROOT / "README.md")) == 1
    run_blocks(ROOT / "README.md")
