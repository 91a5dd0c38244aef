"""fxinit's Triton kernel of the portable stream, run under Triton's interpreter on the CPU:
the C kernel's bits for every kind, dtype, fused cast, offset and stream; the pipeline's
``compile='triton'``; and compile=None choosing it for CUDA. Plus the threaded compiled
paths, which must never crash or recompile on the materializer's worker threads."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import fxinit
from fxinit import execute
from fxinit.backends import compiled, parallel
from fxinit.errors import DeferredInitError
from fxinit.rng import portable, portable_cuda, portable_triton

pytest.importorskip("triton")

KINDS = {"uniform": {"low": -0.25, "high": 0.75}, "normal": {"mean": 0.1, "std": 0.02}}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _triton(kind: str, start: int, n: int, stream: int, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    scale, shift = portable.affine(kind, KINDS[kind])
    out = torch.full((n,), float("nan"), dtype=out_dtype)
    portable_triton.fill(out, kind, start, stream, scale, shift, dtype=dtype, interpret=True)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_computes_the_c_kernels_bits(kind: str, dtype: torch.dtype) -> None:
    """Whole blocks, a partial last block, odd first and last elements, one element; starts
    past 2**31 and 2**32 (a shard far into a large tensor); streams of every sign."""
    block = 2 * portable_triton.BLOCK
    cases = [(0, 3 * block + 5), (7, block), (1, 1), (2, 2), (2**31 - 1, 9), (2**31, 8), (2**32 + 3, 11)]
    for stream in (portable.stream_key(0, "w/0"), -1, 0, 2**31 + 7, 2**63 - 1, -2**63):
        for start, n in cases:
            want = portable.fill_(torch.empty(n, dtype=dtype), kind, stream, first=start,  # C kernel: f32, bf16
                                  **KINDS[kind])
            got = _triton(kind, start, n, stream, dtype, dtype)
            assert torch.equal(_bits(got), _bits(want)), (kind, dtype, stream, start, n)


@pytest.mark.parametrize("fill_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_a_fused_cast_rounds_to_the_fills_dtype_then_the_outputs(fill_dtype: torch.dtype,
                                                                 out_dtype: torch.dtype) -> None:
    stream = portable.stream_key(3, "emb.weight/0")
    want = portable.sample("normal", stream, 5, 4099, fill_dtype, "cpu", **KINDS["normal"]).to(out_dtype)
    assert torch.equal(_bits(_triton("normal", 5, 4099, stream, fill_dtype, out_dtype)), _bits(want))


class Fills(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 300)
        nn.init.normal_(self.a.weight, std=0.02)
        self.chain = nn.Parameter(torch.randn(1000, 7) * 0.02 + 1)  # the chain runs as its own nodes
        self.low = nn.Parameter(torch.rand(333, dtype=torch.bfloat16) * 2 - 1)
        self.big = nn.Parameter(torch.empty(300, 512))
        nn.init.uniform_(self.big, -0.1, 0.1)
        self.emb = nn.Embedding(50, 16, padding_idx=0)


@pytest.fixture(scope="module")
def graph() -> fxinit.InitGraph:
    torch.manual_seed(0)
    return fxinit.init_graph(fxinit.trace_init(Fills))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k


def test_compile_triton_runs_the_pipeline_with_the_same_values(graph: fxinit.InitGraph,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plan = graph.plan(rng="portable", compile="triton")
    assert {k.backend for k in plan.kernels.values()} == {"triton"} and len(plan.kernels) == 6
    assert all(not k.chain for k in plan.kernels.values())
    assert "compiled kernel (triton) on cpu: normal -> float32" in str(plan)
    before = compiled.STATS.calls
    _same(graph.materialize(rng="portable", compile="triton"), graph.materialize(rng="portable", compile=False))
    assert compiled.STATS.calls - before >= len(plan.kernels)
    _same(graph.materialize(rng="portable", compile="triton", dtype=torch.bfloat16),
          graph.materialize(rng="portable", compile=False, dtype=torch.bfloat16))
    rows = {"big": (100, 137)}
    _same(graph.materialize(["big"], rng="portable", compile="triton", rows=rows),
          graph.materialize(["big"], rng="portable", compile=False, rows=rows))
    torch.manual_seed(0)
    m = fxinit.materialize(fxinit.trace_init(Fills), rng="portable", compile="triton")
    _same(dict(m.state_dict()), graph.materialize(rng="portable", compile=False))


def test_compile_triton_on_the_cpu_needs_the_interpreter(graph: fxinit.InitGraph,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(DeferredInitError, match="compile='triton'.*TRITON_INTERPRET=1"):
        graph.materialize(rng="portable", compile="triton")
    with pytest.raises(ValueError, match="compile='inductor'"):
        graph.plan(rng="portable", compile="inductor")


def test_compile_none_takes_fxinits_triton_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default on CUDA: no Dynamo, so nothing compiles on worker threads (issue 33's crash);
    without Triton, fxinit's CUDA kernel (NVRTC), else torch ops; Inductor only when asked
    (compile=True)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(compiled, "_triton_compiles_for_cuda", lambda: True)  # torch's check wants a GPU
    assert execute.compiles(None)(cuda) == "triton"
    monkeypatch.setattr(execute, "compile_available", lambda device: None)  # torch's has_triton wants a GPU
    assert execute.compiles(True)(cuda) == "inductor"
    assert execute.compiles(False) is None
    monkeypatch.setattr(compiled, "_triton_compiles_for_cuda", lambda: False)  # a pre-Volta GPU, a broken Triton
    assert execute.compiles(None)(cuda) is None
    monkeypatch.setattr(portable_triton, "available", lambda: "Triton is not installed")
    assert execute.compiles(None)(cuda) is None  # nor fxinit's CUDA kernel: no CUDA on this machine
    with pytest.raises(DeferredInitError, match="Triton is not installed"):
        execute.compiles("triton")(cuda)
    monkeypatch.setattr(portable_cuda, "available", lambda device: None)  # NVRTC built and checked it
    assert execute.compiles(None)(cuda) == "nvrtc"
    assert execute.compiles("nvrtc")(cuda) == "nvrtc"


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_inductor_kernels_compile_once_and_never_on_worker_threads(graph: fxinit.InitGraph,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker threads start with grad mode on, the caller may have it off: Dynamo's guards saw
    another global state and recompiled there, inside an FX trace that breaks every other
    thread's compiled calls. Each signature compiles once, in ``prepare``, whatever the threads."""
    monkeypatch.setattr(parallel, "SERIAL_BELOW_BYTES", 0)  # every plan on the worker threads
    torch._dynamo.reset()
    compiled._KERNELS.clear()
    compiled._WARM.clear()
    plan = graph.plan(rng="portable", compile=True)
    signatures = {k.signature for k in plan.kernels.values()}
    before = _unique_graphs()
    want = graph.materialize(rng="portable", compile=False)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            assert torch.is_grad_enabled()  # the caller's grad mode: not the interpreter's
            _same(graph.materialize(rng="portable", compile=True), want)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]  # two callers at once, too
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # torch 2.11 crashes where the main thread compiles after another did: none compiles there
    assert _unique_graphs() - before == (0 if compiled._COMPILING_OFF_THE_MAIN_THREAD_CRASHES else len(signatures))


def test_runs_fill_in_one_launch_with_the_streams_elements() -> None:
    """A rank's shard drawn from the runs it is cut from: odd bounds, empty runs, a run cut in
    pieces longer than one launch's second axis holds."""
    import numpy as np

    stream = portable.stream_key(1, "w/0")
    runs = np.array([[0, 5, 0], [7, 7, 5], [1001, 1800, 5], [3, 4, 804], [2**31 + 1, 2**31 + 900, 805]])
    out = torch.full((1705,), float("nan"), dtype=torch.bfloat16)
    portable_triton.fill_runs(out, "normal", runs, stream, 0.02, 0.0, interpret=True)
    for lo, hi, at in runs.tolist():
        want = portable.sample("normal", stream, lo, hi - lo, torch.bfloat16, "cpu", mean=0.0, std=0.02)
        assert torch.equal(_bits(out[at:at + hi - lo]), _bits(want)), (lo, hi)
    short = portable_triton.ROW
    try:
        portable_triton.ROW = 1000  # the cutting, on a size the interpreter runs quickly
        cut = torch.empty(2501, dtype=torch.float32)
        portable_triton.fill_runs(cut, "uniform", [[9, 2510, 0]], stream, 1.0, 0.0, interpret=True)
    finally:
        portable_triton.ROW = short
    assert torch.equal(cut, portable.sample("uniform", stream, 9, 2501, torch.float32, "cpu", low=0.0, high=1.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_fills_in_one_launch_each_with_its_own_stream(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's fills of one kind and dtype in one launch (``fill_many``, for
    ``passes.batched_fills``): each tensor its own stream, scale and shift, sizes odd and
    even, one element, and tensors longer than a row of the launch's table (cut)."""
    monkeypatch.setattr(portable_triton, "ROW", 2 * portable_triton.BLOCK)  # the cutting, quickly
    for kind, params in KINDS.items():
        sizes = (1, 2, 7, 2 * portable_triton.BLOCK, 4 * portable_triton.BLOCK + 3, 5000)
        outs = [torch.full((n,), float("nan"), dtype=dtype) for n in sizes]
        streams = [portable.stream_key(k, f"t{k}/0") for k in range(len(sizes))]
        pieces = [(out, [(0, out.numel(), 0)], stream, *portable.affine(kind, params))
                  for out, stream in zip(outs, streams)]
        portable_triton.fill_many(kind, pieces, interpret=True)
        for out, stream in zip(outs, streams):
            want = portable.sample(kind, stream, 0, out.numel(), dtype, "cpu", **params)
            assert torch.equal(_bits(out), _bits(want)), (kind, out.numel())


def test_shards_draw_straight_from_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies of pieces of a fill (tensor- and row-parallel chunks, FSDP's padded buffer) draw
    their elements straight from the kernel (``plan.forwards``): no whole temporary."""
    from test_forwarding import Layouts

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Layouts, torch.bfloat16, "normal"))
    plan = g.plan(rng="portable", seed=1, compile="triton")
    drawn = {f.fill for fs in plan.forwards.values() for f in fs}
    assert drawn and all(plan.kernels[f].backend == "triton" for f in drawn), str(plan)
    before = compiled.STATS.calls
    _same(g.materialize(rng="portable", seed=1, compile="triton"), g.materialize(rng="portable", seed=1))
    assert compiled.STATS.calls - before >= len(drawn)
    # prepare compiled both of Triton's variants before anything ran: the fill, and the table
    assert {("table" in key) for key in compiled._WARM if key[0] in {plan.kernels[f].signature for f in drawn}} \
        == {False, True}


@pytest.mark.parametrize("arch", [80, 90])
def test_the_gpu_kernel_compiles_with_every_float_operation_rounded_on_its_own(arch: int) -> None:
    """The jitted kernel (not the interpreter's Python) built for an A100 and an H100 by
    Triton's own ptxas, on this CPU machine: every float32 multiply and add carries ``.rn``
    (which ptxas never contracts into a fused multiply-add), no ``fma`` at all, square roots
    correctly rounded (``sqrt.rn``, not ``sqrt.approx``)."""
    import re
    from collections import Counter

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = portable_triton._kernel(False)
    for kind, dtype, out, runs in ((1, tl.bfloat16, tl.bfloat16, False), (1, tl.float32, tl.float16, True),
                                   (0, tl.float16, tl.float32, False)):
        signature = {"out_ptr": f"*{ {tl.bfloat16: 'bf16', tl.float16: 'fp16', tl.float32: 'fp32'}[out] }",
                     "table_ptr": "*i64", "n": "i64", "start": "i64", "stream": "i64", "scale": "fp32", "shift": "fp32",
                     **{k: "constexpr" for k in ("KIND", "DTYPE", "OUT", "BLOCK", "TABLE")}}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={"KIND": kind, "DTYPE": dtype, "OUT": out, "BLOCK": portable_triton.BLOCK,
                                       "TABLE": runs})
        ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=portable_triton.OPTIONS).asm["ptx"]
        ops = Counter(re.findall(r"^\s*((?:add|sub|mul|fma|sqrt|div|rcp)\.[a-z0-9.]+)", ptx, re.M))
        floats = {op: k for op, k in ops.items() if ".f32" in op or ".f16" in op or ".bf16" in op}
        assert floats and all(".rn." in op for op in floats), floats
        assert not any(op.startswith(("fma", "div", "rcp")) for op in floats), floats
        assert (ops["sqrt.rn.f32"] > 0) == (kind == 1), ops


def test_launches_run_on_the_tensors_gpu() -> None:
    """Triton launches on the thread's current CUDA device, device 0 on a fresh worker thread:
    each launch makes the tensor's device current (``torch.cuda.device`` is entered only then)."""
    class OnSecondGpu:
        device = torch.device("cuda", 1)

    guard = portable_triton.device_of(OnSecondGpu())  # type: ignore[arg-type]
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(portable_triton.device_of(torch.empty(1)), torch.cuda.device)


def test_a_cast_the_kernel_cannot_write_runs_uncompiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill fused with a cast to float64 (``dtype=torch.float64``) is not a Triton kernel:
    it runs as the portable sampler does, with the same values."""
    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(2048, 1100))
            nn.init.normal_(self.w, std=0.02)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Big))
    plan = g.plan(rng="portable", compile="triton", dtype=torch.float64)
    assert plan.fused_casts and not plan.kernels, str(plan)
    _same(g.materialize(rng="portable", compile="triton", dtype=torch.float64),
          g.materialize(rng="portable", compile=False, dtype=torch.float64))


def test_fills_of_one_storage_never_share_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch fills its table's rows in no order: where dead-write elimination is off, a
    tensor filled three times keeps the last fill's values (only the first fill, of the
    allocation itself, is batched; the batch runs before the next writes the storage)."""
    class Refilled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(64, 64))
            nn.init.uniform_(self.w)
            nn.init.normal_(self.w)
            nn.init.uniform_(self.w, -3, -2)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Refilled))
    targets = list(g._targets(["w"]))
    for compile in ("triton", None):
        plan = execute.plan(g, targets, rng="portable", seed=3, eliminate_dead=False, compile=compile)
        assert len(plan.batches.fills) == 1 and sum(map(bool, (n.meta.get("generators") for n in plan.nodes))) == 3
        value = execute.run(g, plan)[targets[0][0]]
        assert torch.equal(value, g.materialize(["w"], rng="portable", seed=3)["w"]), compile
        assert value.max() <= -2
