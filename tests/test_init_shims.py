"""torch 2.11's opaque init functions, which do not ask ``is_meta`` (``capture.init_shims``).

torch 2.11 is not installed here, so each run gives torch's own function objects the bodies
torch 2.11 has (no ``is_meta`` question) in a fresh process before fxinit is imported, as on
a machine with torch 2.11: on an H100 with torch 2.11, ViT's float32 ``trunc_normal_`` tensor
was recorded op by op and its portable values were torch's ``erfinv_``, 2 units in the last
place from the CPU's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import TORCH_RELEASE

TORCH_2_11_BODIES = '''
import math, warnings
import torch
import torch.nn.init as I

def _no_grad_trunc_normal_(tensor, mean, std, a, b, generator=None):
    def norm_cdf(x):
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0
    if (mean < a - 2 * std) or (mean > b + 2 * std):
        warnings.warn("mean is more than 2 std from [a, b]", stacklevel=2)
    with torch.no_grad():
        l = norm_cdf((a - mean) / std)
        u = norm_cdf((b - mean) / std)
        tensor.uniform_(2 * l - 1, 2 * u - 1, generator=generator)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0))
        tensor.add_(mean)
        tensor.clamp_(min=a, max=b)
        return tensor

def orthogonal_(tensor, gain=1, generator=None):
    if tensor.ndimension() < 2:
        raise ValueError("Only tensors with 2 or more dimensions are supported")
    if tensor.numel() == 0:
        return tensor
    rows = tensor.size(0)
    cols = tensor.numel() // rows
    flattened = tensor.new_empty((rows, cols)).normal_(0, 1, generator=generator)
    if rows < cols:
        flattened.t_()
    q, r = torch.linalg.qr(flattened)
    d = torch.diag(r, 0)
    ph = d.sign()
    q *= ph
    if rows < cols:
        q.t_()
    with torch.no_grad():
        tensor.view_as(q).copy_(q)
        tensor.mul_(gain)
    return tensor

for _fn in (_no_grad_trunc_normal_, orthogonal_):
    getattr(I, _fn.__name__).__code__ = _fn.__code__
'''

MODEL = '''
import torch, fxinit
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(40, 24)
        self.b = nn.Linear(24, 48)
        self.cls = nn.Parameter(torch.randn(1, 1, 24))
        nn.init.trunc_normal_(self.a.weight, std=0.02)
        nn.init.trunc_normal_(self.cls, std=0.02)
        nn.init.orthogonal_(self.b.weight, gain=2.0)

def eager():
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Net().state_dict().items()}

before = eager()
torch.manual_seed(0)
m = fxinit.trace_init(Net)
graph = fxinit.init_graph(m)
opaque = sorted({n.meta.get("opaque") for n in graph.graph.nodes if n.meta.get("opaque")})
targets = {str(getattr(n.target, "__name__", n.target)) for n in graph.graph.nodes}
portable = graph.materialize(rng="portable")
fxinit.materialize(m)
exact = {k: v.detach() for k, v in m.state_dict().items()}
after = eager()  # the functions' new bodies run real tensors as torch's own did
cuda_opaque = None
if SIMULATED and not torch.cuda.is_available():  # a device this process lacks: op by op, as torch 2.11 records it
    with torch.device("cuda"):
        cuda = fxinit.init_graph(fxinit.trace_init(Net))
    cuda_opaque = sorted({n.meta.get("opaque") for n in cuda.graph.nodes if n.meta.get("opaque")})
from fxinit.capture.init_shims import shimmed
graph.save(OUT + ".graph")
torch.save(dict(before=before, after=after, exact=exact, portable=portable, opaque=opaque,
                erfinv="erfinv_.default" in targets, cuda_opaque=cuda_opaque, shimmed=sorted(shimmed())), OUT)
'''


def _python(script: str) -> str:
    """Run ``script`` in a fresh interpreter; its standard output."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _run(tmp_path: Path, name: str, simulate: bool) -> dict:
    out = tmp_path / f"{name}.pt"
    _python((TORCH_2_11_BODIES if simulate else "") + f"\nOUT = {str(out)!r}\nSIMULATED = {simulate}\n" + MODEL)
    return {**torch.load(out, weights_only=False), "graph": f"{out}.graph"}


def _bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
        for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("shims")
    return _run(tmp, "torch_2_11", simulate=True), _run(tmp, "installed", simulate=False)


#: The init functions the simulated bodies of torch 2.11 give no ``is_meta`` question.
SIMULATED = ["torch.nn.init._no_grad_trunc_normal_", "torch.nn.init.orthogonal_", "torch.nn.init.trunc_normal_"]
#: Those of the installed torch: on torch 2.11 itself ``dirac_`` and ``sparse_`` ask none either.
INSTALLED = [] if TORCH_RELEASE >= (2, 12) else sorted([*SIMULATED, "torch.nn.init.dirac_", "torch.nn.init.sparse_"])


def test_torch_2_11_init_functions_are_recorded_whole(runs: tuple[dict, dict]) -> None:
    old, _ = runs
    assert old["shimmed"] == (INSTALLED or SIMULATED)
    assert old["opaque"] == ["torch.nn.init.orthogonal_", "torch.nn.init.trunc_normal_"]
    assert not old["erfinv"]


def test_exact_values_stay_eager_and_real_tensors_run_torch_code(runs: tuple[dict, dict]) -> None:
    old, _ = runs
    assert _bits_equal(old["exact"], old["before"])
    assert _bits_equal(old["after"], old["before"])


def test_portable_values_are_those_of_later_torch(runs: tuple[dict, dict]) -> None:
    """Recorded whole, ``trunc_normal_`` draws fxinit's own portable sampler, as with the
    installed torch (whose functions ask ``is_meta`` themselves). ``orthogonal_`` is QR of
    portable normals on both."""
    old, new = runs
    assert new["shimmed"] == INSTALLED
    assert _bits_equal(old["portable"], new["portable"])


def test_absent_device_is_recorded_op_by_op(runs: tuple[dict, dict]) -> None:
    """For a device this process lacks, a whole call could not say how far it moves that
    device's generator; op by op it can, as torch 2.11 recorded it without fxinit's help."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    old, _ = runs
    assert old["cuda_opaque"] == []


def test_a_graph_recorded_with_other_init_functions_is_not_replayed_exactly(runs: tuple[dict, dict]) -> None:
    """Saved with torch 2.11's ``trunc_normal_`` and loaded with this torch's, whose body differs:
    exact replay would give other values than 2.11's eager, so it is refused by name; the
    portable mode uses fxinit's own samplers and runs."""
    old, _ = runs
    import fxinit
    from fxinit.errors import DeferredInitError

    graph = fxinit.load_graph(old["graph"])
    assert graph.stats() and repr(graph)  # looking at it is not refused
    with pytest.raises(DeferredInitError, match="trunc_normal_ of this torch .* is not the one"):
        graph.materialize(["a.weight"])
    assert _bits_equal({"b.bias": graph.materialize(["b.bias"])["b.bias"]}, {"b.bias": old["before"]["b.bias"]})
    assert _bits_equal(graph.materialize(rng="portable"), old["portable"])


def test_functions_put_in_torchs_place_are_left_alone() -> None:
    """The first trace of a process inside transformers' ``no_init_weights`` (which puts
    functions of ``*args`` in ``torch.nn.init``'s place) or ``guard_torch_init_functions``
    (its own guarded ones) gives only torch's own functions a body: transformers' guard still
    skips a tensor it marked initialized."""
    out = _python(TORCH_2_11_BODIES + """
import torch, fxinit
from torch import nn
from transformers import initialization as init

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 4))
        self.w._is_hf_initialized = True
        init.trunc_normal_(self.w, std=0.02)

with init.no_init_weights():
    fxinit.trace_init(nn.Linear, 4, 4)
with init.guard_torch_init_functions():
    fxinit.trace_init(nn.Linear, 2, 2)
from fxinit.capture.init_shims import shimmed
print(sorted(shimmed()))
m = fxinit.trace_init(Net)
fxinit.materialize(m)
print(float(m.w.detach().abs().sum()))
""")
    shims, total = out.strip().splitlines()
    assert shims == str(INSTALLED or SIMULATED)
    assert float(total) == 0.0


BASE = '''
import torch, fxinit
from torch import nn

class Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.empty(8, 6)); nn.init.trunc_normal_(self.a, std=0.02)
        self.b = nn.Parameter(torch.empty(6, 6)); nn.init.orthogonal_(self.b)
        self.c = nn.Parameter(torch.empty(10, 5)); nn.init.sparse_(self.c, 0.3)
        self.d = nn.Parameter(torch.empty(4, 4, 3)); nn.init.dirac_(self.d)

def eager():
    torch.manual_seed(0)
    return {k: v.detach() for k, v in Opaque().state_dict().items()}

def same(got):
    want = eager()
    return all(torch.equal(got[k], want[k]) for k in want)
'''


@pytest.mark.parametrize("context", ["no_init_weights", "guard_torch_init_functions"])
def test_fxinit_imported_while_transformers_replaces_torchs_init_functions(tmp_path: Path, context: str) -> None:
    """fxinit imported inside a context that puts transformers' functions in ``torch.nn.init``'s
    place still knows torch's own: a graph saved by another process replays exactly (no false
    refusal), and a trace in this process records and replays torch's functions."""
    path = tmp_path / "opaque.pt"
    _python(BASE.replace("import torch, fxinit", "import torch") + f"""
import fxinit
torch.manual_seed(0)
fxinit.init_graph(fxinit.trace_init(Opaque)).save({str(path)!r})
""")
    out = _python(f"""
import torch
from transformers import initialization
with initialization.{context}():
    import fxinit
""" + BASE + f"""
print(same(fxinit.load_graph({str(path)!r}).materialize()))
torch.manual_seed(0)
m = fxinit.trace_init(Opaque)
fxinit.materialize(m)
print(same({{k: v.detach() for k, v in m.state_dict().items()}}))
""")
    assert out.split() == ["True", "True"]


def test_replay_runs_torchs_functions_whatever_stands_in_their_place(tmp_path: Path) -> None:
    """Materialized inside transformers' ``no_init_weights`` (whose ``torch.nn.init`` functions
    do nothing), the opaque nodes still run torch's own functions: eager's values."""
    import fxinit
    from transformers import initialization

    namespace: dict = {}
    exec(BASE, namespace)
    torch.manual_seed(0)
    graph = fxinit.init_graph(fxinit.trace_init(namespace["Opaque"]))
    with initialization.no_init_weights():
        got = graph.materialize()
    assert namespace["same"](got)
