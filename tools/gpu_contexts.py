"""The device-context section of ``tools/gpu_check.py`` (issue 32): ordinary constructors,
each random op and init function alone, built under ``with torch.device(DEVICE)`` eagerly and
with fxinit, compared bit for bit (values, devices, dtypes), whole and leaf by leaf in
reverse; and on CUDA the same constructors traced in a process that sees no GPU
(``CUDA_VISIBLE_DEVICES=""``: fxinit follows CUDA's generator by the offsets its kernels
reserve, ``fxinit/rng/philox.py``), saved as init graphs, and materialized here.

    PYTHONPATH=. python tools/gpu_contexts.py --device cuda     # alone
    python tools/gpu_contexts.py --device cpu                   # the same constructors on the CPU
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxinit  # noqa: E402

# sizes around the CUDA kernels' thresholds: one block, a saturated grid (132 SMs x 8 blocks
# x 256 threads x unroll 4 = 1081344 elements on an H100), beyond it, and uneven
SIZES = (1, 1000, 1081344, 1081345, 3 * 2**20 + 7)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# data-dependent draws (rejection rounds, QR, randperm): recorded only where the device exists
OPAQUE = {"trunc_normal_": nn.init.trunc_normal_, "orthogonal_": nn.init.orthogonal_,
          "sparse_": lambda t: nn.init.sparse_(t, 0.3)}


class Ops(nn.Module):
    """Every random op and ``nn.init`` function, on one size and dtype."""

    def __init__(self, n: int, dtype: torch.dtype, device_here: bool = True) -> None:
        super().__init__()
        for i, fill in enumerate([
            lambda t: t.uniform_(-1, 2), lambda t: t.normal_(0.5, 2.0), lambda t: t.bernoulli_(0.3),
            lambda t: t.exponential_(), lambda t: t.cauchy_(), lambda t: t.log_normal_(), lambda t: t.geometric_(0.2),
            lambda t: t.random_(0, 100), nn.init.uniform_, nn.init.normal_,
            OPAQUE["trunc_normal_"] if device_here else nn.init.zeros_, lambda t: nn.init.constant_(t, 0.5),
        ]):
            self.register_buffer(f"fill{i}", fill(torch.empty(n, dtype=dtype)))
        self.register_buffer("rand", torch.rand(n, dtype=dtype))
        self.register_buffer("randn", torch.randn(n, dtype=dtype))
        self.register_buffer("randint", torch.randint(0, 10, (n,)))
        self.register_buffer("randint_wide", torch.randint(0, 2**40, (n,)))
        self.register_buffer("drop", F.dropout(torch.ones(n, dtype=dtype), 0.25))
        self.register_buffer("drop_inplace", F.dropout(torch.ones(n, dtype=dtype), 0.25, inplace=True))
        self.register_buffer("normal_cpu", torch.normal(0.0, 1.0, size=(n,)))  # no device: the CPU's
        self.register_buffer("normal_t", torch.normal(torch.zeros(n, dtype=dtype), 2.0))
        self.register_buffer("like", torch.randn_like(self.randn))


class Samplers(nn.Module):
    """Samplers whose CPU kernels draw as many numbers as their inputs' values ask for (CUDA's
    reserve a fixed Philox offset): refused when tracing for a device this machine lacks."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("gamma", torch._standard_gamma(torch.linspace(0.05, 3.0, n, dtype=dtype)))
        self.register_buffer("poisson", torch.poisson(torch.linspace(0.0, 40.0, n, dtype=dtype)))
        self.register_buffer("binomial", torch.binomial(torch.full((n,), 30.0, dtype=dtype),
                                                        torch.linspace(0.0, 1.0, n, dtype=dtype)))
        self.register_buffer("dirichlet", torch._sample_dirichlet(torch.linspace(0.1, 2.0, 4 * n, dtype=dtype)
                                                                  .reshape(n, 4)))
        self.register_buffer("rrelu", F.rrelu(torch.linspace(-1.0, 1.0, n, dtype=dtype), training=True))
        self.after = nn.Parameter(torch.randn(n, dtype=dtype))  # where each sampler left the generator


class Inits(nn.Module):
    """The ``nn.init`` functions on matrices, and the modules with device-dependent branches."""

    def __init__(self, device_here: bool = True) -> None:
        super().__init__()
        w = torch.empty(48, 40)
        for i, init in enumerate([nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.kaiming_uniform_,
                                  nn.init.kaiming_normal_, nn.init.eye_, *(OPAQUE.values() if device_here else ())]):
            self.register_parameter(f"w{i}", nn.Parameter(init(w.clone())))
        self.dirac = nn.Parameter(nn.init.dirac_(torch.empty(4, 4, 3)))
        with torch.no_grad():  # singular values and eigenvalues without vectors, as eager computes them
            self.register_buffer("spectral", torch.stack([
                torch.linalg.matrix_norm(self.w0, ord=2), torch.linalg.eigvalsh(self.w0.T @ self.w0)[-1],
                torch.norm(self.w0, p="nuc")]))
        self.lstm = nn.LSTM(8, 16, 2)
        self.gru = nn.GRU(8, 8, bidirectional=True)
        self.emb = nn.Embedding(100, 16, padding_idx=0)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("eye_out", torch.eye(5, out=torch.empty(5, 5)))
        self.register_buffer("legacy", torch.Tensor(3).zero_())
        self.register_buffer("idx", torch.arange(10))
        here = torch.empty(0).device  # the context's device, as model code reads it
        cpu = torch.arange(6.0, device="cpu").reshape(2, 3)
        self.register_buffer("moved", cpu.to(device=here))  # moves onto the context's device
        self.register_buffer("moved_half", cpu.to(here, torch.float16))
        self.register_buffer("moved_like", torch.full_like(cpu, 2.0, device=here))
        self.register_buffer("moved_new", cpu.new_ones(3, device=here))
        self.register_buffer("moved_other", cpu.to(self.emb.weight))
        self.register_buffer("moved_type_as", cpu.type_as(self.emb.weight.half()))
        self.register_buffer("moved_back", self.emb.weight.to(cpu.double()))  # onto the CPU, as float64
        self.register_buffer("moved_numpy", torch.from_numpy(np.arange(3.0)).to(here))
        self.register_buffer("moved_skeleton", torch.empty_like(torch.empty(4, device="meta"), device=here).fill_(1))
        if device_here:  # a sparse tensor is kept real: built on the device, as eager's
            self.sparse = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([3.0, 4.0]), (2, 2))
            self.register_buffer("sparse_dense", self.sparse.to_dense())


def constructors(device_here: bool = True, sizes: tuple[int, ...] = SIZES) -> dict[str, Callable[[], nn.Module]]:
    """The constructors by name; ``device_here=False`` leaves out the init functions and samplers
    whose draws depend on their values (refused when tracing for a device this machine lacks)."""
    out: dict[str, Callable[[], nn.Module]] = {"inits": lambda: Inits(device_here)}
    for dtype in DTYPES:
        for n in sizes:
            out[f"ops {str(dtype).split('.')[-1]} {n}"] = lambda n=n, dtype=dtype: Ops(n, dtype, device_here)
    for dtype in (torch.float32, torch.float64) if device_here else ():  # (their CPU kernels' dtypes)
        for n in sizes[:4]:
            out[f"samplers {str(dtype).split('.')[-1]} {n}"] = lambda n=n, dtype=dtype: Samplers(n, dtype)
    return out


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in [*m.named_parameters(), *m.named_buffers()]}


def _differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    if got.keys() != want.keys():
        return [f"names differ: {sorted(got.keys() ^ want.keys())[:4]}"]
    bad = []
    for k, w in want.items():
        g = got[k]
        if g.device != w.device or g.dtype != w.dtype or g.shape != w.shape:
            bad.append(f"{k}: {g.device} {g.dtype} vs eager's {w.device} {w.dtype}")
        elif not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
            bad.append(f"{k}: values differ")
    return bad


def check_one(name: str, factory: Callable[[], nn.Module], device: torch.device) -> list[str]:
    """Eager and fxinit under ``with device``, whole and leaf by leaf in reverse."""
    torch.manual_seed(0)
    with device:
        want = _state(factory())
    problems = []
    for order in ("whole", "reverse"):
        torch.manual_seed(0)
        try:
            with device:
                m = fxinit.trace_init(factory)
            if order == "whole":
                fxinit.materialize(m)
            else:
                for leaf in reversed([x for x in m.modules() if not list(x.children())] + [m]):
                    fxinit.materialize(leaf)
            problems += [f"{name} ({order}): {p}" for p in _differences(_state(m), want)]
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{name} ({order}): {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return problems


_TRACE_ELSEWHERE = """
import sys, torch, fxinit
sys.path.insert(0, {tools!r})
import gpu_contexts
assert not torch.cuda.is_available()
for i, (name, factory) in enumerate(gpu_contexts.constructors(device_here=False).items()):
    torch.manual_seed(0)
    try:
        with torch.device("cuda"):
            m = fxinit.trace_init(factory)
        fxinit.init_graph(m).save(f"{out}/{{i}}.pt")
    except Exception as exc:
        print(f"{{name}}: {{type(exc).__name__}}: {{str(exc).splitlines()[0]}}")
"""


def check_traced_without_cuda(device: torch.device) -> list[str]:
    """Trace for CUDA where no GPU is visible, materialize the saved graphs here, compare with eager."""
    problems = []
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        code = _TRACE_ELSEWHERE.format(tools=str(Path(__file__).resolve().parent), out=out)
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
        problems += [f"traced without CUDA: {line}" for line in run.stdout.splitlines() if line.strip()]
        if run.returncode:
            return problems + [f"tracing without CUDA failed: {run.stderr[-800:]}"]
        for i, (name, factory) in enumerate(constructors(device_here=False).items()):
            path = Path(out) / f"{i}.pt"
            if not path.exists():
                continue
            torch.manual_seed(0)
            with device:
                want = _state(factory())
            got = fxinit.load_graph(path).materialize()
            problems += [f"{name} (traced without CUDA): {p}" for p in _differences(got, want)]
    return problems


def check_device_contexts(device: torch.device, sizes: tuple[int, ...] = SIZES) -> tuple[list[str], int]:
    """Every constructor both ways; the problems found and how many constructors ran."""
    problems: list[str] = []
    ctors = constructors(sizes=sizes)
    for name, factory in ctors.items():
        problems += check_one(name, factory, device)
    if device.type == "cuda":
        problems += check_traced_without_cuda(device)
    return problems, len(ctors)


def report(problems: list[str], count: int, device: torch.device) -> bool:
    print(f"\ndevice contexts on {device}: {count} constructors (each random op and init function alone, "
          f"{len(DTYPES)} dtypes x sizes {', '.join(map(str, SIZES))}), whole and in reverse"
          + (", and traced without CUDA" if device.type == "cuda" else ""))
    for p in problems[:40]:
        print(f"  {p}")
    print("  all equal to eager, bit for bit" if not problems else f"  {len(problems)} DIFFERENCES")
    return not problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    problems, count = check_device_contexts(device)
    return 0 if report(problems, count, device) else 1


if __name__ == "__main__":
    raise SystemExit(main())
