"""Every operator of PyTorch's OpInfo database inside a constructor, fxinit against eager:
shapes, the layouts recorded and materialized, and the bits (``tools/ops_differential.py``).
Run in a child process: PyTorch's test helpers change global flags when imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ops_differential.py"


def test_every_opinfo_operator_in_a_constructor_equals_eager() -> None:
    run = subprocess.run([sys.executable, str(TOOL), "--samples", "8"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " 0 differ" in run.stdout and int(run.stdout.split(" samples")[0]) > 4000, run.stdout[-2000:]


def test_the_differential_finds_a_layout_the_capture_gets_wrong() -> None:
    """The check can fail: with ``_linalg_svd``'s layout correction taken out, it reports it."""
    code = ("import sys, fxinit.capture.layouts as L; "
            "L._CPU = tuple(e for e in L._CPU if 'svd' not in str(e[0])); "
            f"sys.argv = ['x', '--ops', 'linalg.svd', '--samples', '40']; sys.path.insert(0, {str(TOOL.parent)!r}); "
            "import ops_differential; sys.exit(ops_differential.main())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "strides recorded" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
