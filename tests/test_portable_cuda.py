"""fxinit's CUDA kernel of the portable stream (``rng/portable_cuda.cu``, compiled by NVRTC on a
GPU), checked without one: the same source compiled as C runs its grid block by block and
thread by thread on CPU tensors (``FXINIT_NVRTC_ON_CPU=1``, ``portable_cuda.cpu_launcher``),
against the C kernel's bits; the self-check that guards it on a GPU; and ``compile="nvrtc"``
through the pipeline: whole fills, batched fills, pieces, shards' runs and fused casts."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch

import fxinit
from fxinit.errors import DeferredInitError
from fxinit.rng import portable, portable_cuda

KINDS = {"uniform": {"low": -0.25, "high": 0.75}, "normal": {"mean": 0.1, "std": 0.02}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel compiled as C fills CPU tensors (its availability checked afresh)."""
    monkeypatch.setenv(portable_cuda.ON_CPU, "1")
    portable_cuda._checked.cache_clear()
    yield
    portable_cuda._checked.cache_clear()


def test_the_kernel_passes_its_self_check_compiled_as_c() -> None:
    """Both kinds; float32, bfloat16 and a float32 fill cast to bfloat16; odd bounds, one
    element, a start past 2**31: the torch-op twin's bits (here the C kernel's)."""
    assert portable_cuda.self_check("cpu", portable_cuda.cpu_launcher()) == []


def test_the_self_check_finds_a_kernel_that_differs() -> None:
    """A kernel whose scale is off by one bfloat16 step differs: the check is not vacuous."""
    launch = portable_cuda.cpu_launcher()

    def off(table: torch.Tensor, *rest: int) -> None:
        nudged = table.clone()
        nudged[:, 4] += 1 << 16  # the next bfloat16 after each scale
        launch(nudged, *rest)

    differ = portable_cuda.self_check("cpu", off)
    assert len({d.split(" elements")[0] for d in differ}) == 2 * 3, differ  # every kind and dtype pair


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_fills_in_one_launch(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table of fills of one kind and dtype, each its own stream, scale, shift and runs, one
    run longer than a row (cut)."""
    monkeypatch.setattr(portable_cuda, "ROW", 2 * portable_cuda.PAIRS)
    launch = portable_cuda.cpu_launcher()
    for kind, params in KINDS.items():
        scale, shift = portable.affine(kind, params)
        sizes = (1, 2, 7, 2 * portable_cuda.PAIRS + 1, 5 * portable_cuda.PAIRS + 3)
        outs = [torch.full((n,), float("nan"), dtype=dtype) for n in sizes]
        streams = [portable.stream_key(k, f"t{k}/0") for k in range(len(sizes))]
        portable_cuda.fill_many(kind, [(out, [(0, out.numel(), 0)], stream, scale, shift)
                                       for out, stream in zip(outs, streams)], launch=launch)
        for out, stream in zip(outs, streams):
            want = portable.sample(kind, stream, 0, out.numel(), dtype, "cpu", **params)
            assert torch.equal(_bits(out), _bits(want)), (kind, out.numel())
        shard = torch.full((3000,), float("nan"), dtype=dtype)  # runs of a larger fill (``plan.forwards``)
        runs = [(5, 1005, 0), (4096, 6096, 1000)]
        portable_cuda.fill_many(kind, [(shard, runs, streams[0], scale, shift)], launch=launch)
        for lo, hi, at in runs:
            want = portable.sample(kind, streams[0], lo, hi - lo, dtype, "cpu", **params)
            assert torch.equal(_bits(shard[at:at + hi - lo]), _bits(want)), (kind, lo)


def test_compile_nvrtc_runs_the_pipeline_with_the_same_values(on_cpu: None) -> None:
    """Whole fills (batched), a fill cast to bfloat16 in chunks, and shards drawn straight from
    their fills: the C kernel's values, bit for bit."""
    from test_forwarding import Layouts
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1000)
    cases = [(LlamaForCausalLM, (cfg,), None), (Layouts, (torch.bfloat16, "normal"), None),
             (Layouts, (torch.float32, "uniform"), torch.bfloat16)]
    for cls, args, dtype in cases:
        torch.manual_seed(0)
        g = fxinit.init_graph(fxinit.trace_init(cls, *args))
        plan = g.plan(rng="portable", seed=1, compile="nvrtc", dtype=dtype)
        assert plan.kernels and {k.backend for k in plan.kernels.values()} == {"nvrtc"}, str(plan)
        got = g.materialize(rng="portable", seed=1, compile="nvrtc", dtype=dtype)
        want = g.materialize(rng="portable", seed=1, compile=False, dtype=dtype)
        assert [k for k in want if not torch.equal(got[k], want[k])] == [], cls.__name__
    assert plan.forwards, "the shards were drawn by their copies"


def test_compile_nvrtc_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(portable_cuda.ON_CPU, raising=False)
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(torch.nn.Linear, 8, 8))
    with pytest.raises(DeferredInitError, match="compile='nvrtc': fxinit's CUDA kernel cannot fill cpu tensors"):
        g.materialize(rng="portable", compile="nvrtc")
    assert portable_cuda.available(torch.device("cuda")) is not None  # no GPU on this machine


@pytest.mark.parametrize("arch", ["80", "90"])
def test_nvrtc_compiles_it_with_every_float_operation_rounded_on_its_own(arch: str) -> None:
    """The kernel built by NVRTC (the test dependency ``nvidia-cuda-nvrtc-cu12``: no GPU needed)
    for an A100 and an H100: a cubin, and PTX whose float32 multiplies and adds all carry
    ``.rn`` (never contracted into a fused multiply-add), no ``fma``, no division, a correctly
    rounded square root (``sqrt.rn``)."""
    try:
        portable_cuda._nvrtc()
    except OSError as exc:
        pytest.fail(f"{exc}: install the test dependencies (pip install -e '.[test]')", pytrace=False)
    ptx = portable_cuda.compiled(arch, ptx=True).decode(errors="replace")
    ops = Counter(re.findall(r"^\s*((?:add|sub|mul|fma|sqrt|div|rcp)\.[a-z0-9.]+)", ptx, re.M))
    floats = {op: k for op, k in ops.items() if ".f32" in op}
    assert floats and all(".rn." in op for op in floats), floats
    assert not any(op.startswith(("fma", "div", "rcp")) for op in floats), floats
    assert floats.get("sqrt.rn.f32") == 1, floats
    assert len(portable_cuda.compiled(arch)) > 1000  # the cubin a GPU loads


def test_the_source_has_portable_cs_constants() -> None:
    """Every float constant of the C kernel's log, cos and sin is in the CUDA source, and no other."""
    here = Path(portable_cuda.__file__).parent
    constants = [set(re.findall(r"-?0x1\.[0-9a-f]+p-?\d+f", (here / name).read_text()))
                 for name in ("portable.c", "portable_cuda.cu")]
    assert constants[0] and constants[0] == constants[1]


def test_compile_nvrtc_on_the_materializers_threads(on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups on worker threads launch side by side (the C build keeps its grid indices per thread)."""
    from fxinit.backends import parallel

    monkeypatch.setattr(parallel, "SERIAL_BELOW_BYTES", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(lambda: torch.nn.Sequential(*(torch.nn.Linear(256, 256)
                                                                           for _ in range(8)))))
    want = g.materialize(rng="portable", seed=1, compile=False)
    for _ in range(3):
        got = g.materialize(rng="portable", seed=1, compile="nvrtc")
        assert [k for k in want if not torch.equal(got[k], want[k])] == []
