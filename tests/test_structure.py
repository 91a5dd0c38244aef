"""The shape of the code: fxinit's modules import each other without cycles, lazy imports
(inside functions) included, and none of them is long."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "fxinit"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The fxinit modules an AST imports when it runs, wherever the import statement is
    (module level, functions, methods); ``if TYPE_CHECKING:`` blocks never run."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in found if m in modules}


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in _imports(ast.parse(path.read_text()), modules):
            if target != name:
                graph.add_edge(name, target)
    return graph


def test_the_import_graph_sees_lazy_imports() -> None:
    graph = import_graph()
    assert graph.has_edge("fxinit.graph", "fxinit.execute")
    tree = ast.parse("def f():\n    from fxinit.graph import InitGraph\nif TYPE_CHECKING:\n    import fxinit.plan\n")
    assert _imports(tree, _modules()) == {"fxinit.graph"}


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in cycles[:5])


def test_no_long_modules() -> None:
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_importing_fxinit_imports_no_torch_distributed_module() -> None:
    """FSDP1's ``_init_utils`` imports ``torchdistx`` while it is imported; with fxinit's
    stand-in installed that imports fxinit, which must not import ``_init_utils`` back."""
    code = """
import sys, torch
before = {m for m in sys.modules if m.startswith("torch.distributed")}
import fxinit
added = sorted(m for m in sys.modules if m.startswith("torch.distributed") and m not in before)
assert not added, added
import fxinit.torchdistx
fxinit.torchdistx.install()
import torch.distributed.fsdp
from torch.distributed.fsdp import _init_utils
assert _init_utils._TORCHDISTX_AVAIL and _init_utils.deferred_init is fxinit.torchdistx.deferred_init
from torch.distributed.tensor import DTensor
from fxinit.capture import dtensor
assert dtensor.DTensor is DTensor and getattr(DTensor.__init__, "_fxinit", False)
import doctest
failed, attempted = doctest.testmod(fxinit.torchdistx)
assert attempted and not failed
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_doctests_of_new_modules() -> None:
    import doctest

    from fxinit import module_to
    from fxinit.capture import indices, legacy_types, materialized_marks, post_import, real_storages
    from fxinit.passes import waves

    for module in (module_to, post_import, indices, waves, real_storages, legacy_types, materialized_marks):
        failed, attempted = doctest.testmod(module)
        assert attempted and not failed, module.__name__


def test_a_torchdistx_of_ones_own_that_imports_fxinit(tmp_path) -> None:
    """The issue's case: a ``torchdistx`` module of the user's handing on fxinit's functions,
    imported by FSDP1's ``_init_utils`` while that is being imported (so fxinit is imported
    then too); FSDP1 then builds a unit through it, equal to eager."""
    (tmp_path / "torchdistx").mkdir()
    (tmp_path / "torchdistx" / "__init__.py").write_text("from fxinit.torchdistx import deferred_init, fake\n")
    code = f"""
import os, sys
sys.path.insert(0, {str(tmp_path)!r})
import torch, torch.nn as nn, torch.distributed as dist
import torch.distributed.fsdp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, _init_utils
import fxinit
assert _init_utils._TORCHDISTX_AVAIL
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str({_free_port()}))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
eager = FSDP(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), device_id=torch.device("cpu"))
torch.manual_seed(0)
ours = FSDP(fxinit.deferred_init(lambda: nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))), device_id=torch.device("cpu"))
with FSDP.summon_full_params(eager), FSDP.summon_full_params(ours):
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), ours.state_dict().values()))
dist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
