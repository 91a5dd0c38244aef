"""Portable fills compiled by torch.compile (Inductor): the same bits as fxinit's C kernel, a
handful of kernels per model, and compile=None/True/False as documented."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import fxinit
from fxinit import execute
from fxinit.backends import compiled
from fxinit.errors import DeferredInitError
from fxinit.rng.native import portable_library

F32, BF16 = torch.float32, torch.bfloat16


class Fills(nn.Module):
    """Every kind of compiled fill: in-place samplers, factories with element-wise chains (in
    float32 and bfloat16), a fill large enough to be cast chunk-free with dtype=, and a fill
    whose rows are asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(512, 300)
        nn.init.normal_(self.a.weight, std=0.02)
        self.chain = nn.Parameter(torch.randn(1000, 7) * 0.02 + 1)
        self.low = nn.Parameter(torch.rand(333, dtype=BF16) * 2 - 1)
        self.big = nn.Parameter(torch.empty(300, 512))
        nn.init.uniform_(self.big, -0.1, 0.1)
        self.tail = nn.Parameter(torch.randn(1).exp())  # exp stays out of kernels: not exactly rounded


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])), k


@pytest.fixture(scope="module")
def graph() -> fxinit.InitGraph:
    torch.manual_seed(0)
    return fxinit.init_graph(fxinit.trace_init(Fills))


def test_compiled_fills_are_the_c_kernels_bits(graph: fxinit.InitGraph) -> None:
    plan = graph.plan(rng="portable", compile=True)
    chains = {tuple(str(n.target) for n in k.chain) for k in plan.kernels.values()}
    bf16_chain = {("aten.mul.Tensor", "aten.sub.Tensor")} if _keeps_roundings() else set()
    assert chains == {(), ("aten.mul.Tensor", "aten.add.Tensor"), *bf16_chain}
    assert {(k.kind, k.dtype) for k in plan.kernels.values()} == {("normal", F32), ("uniform", F32), ("uniform", BF16)}
    assert "compiled kernel (inductor) on cpu: normal -> float32 -> mul -> add" in str(plan)
    before = compiled.STATS.calls
    _same(graph.materialize(rng="portable", compile=True), graph.materialize(rng="portable", compile=False))
    big_enough = [n for n in plan.kernels  # smaller fills run eagerly
                  if (n.meta.get("spec") or n.args[0].meta["spec"]).numel >= compiled.MIN_ELEMENTS]
    assert compiled.STATS.calls - before >= len(big_enough) == len(plan.kernels) - 1  # the kernels ran

    cast = graph.plan(rng="portable", compile=True, dtype=BF16)
    assert any(k.cast == BF16 for k in cast.kernels.values())  # a fused cast written in bfloat16 directly
    _same(graph.materialize(rng="portable", compile=True, dtype=BF16),
          graph.materialize(rng="portable", compile=False, dtype=BF16))

    rows = {"big": (100, 137)}  # only the pieces a row range needs
    assert graph.plan(["big"], rng="portable", compile=True, rows=rows).pieces
    _same(graph.materialize(["big"], rng="portable", compile=True, rows=rows),
          graph.materialize(["big"], rng="portable", compile=False, rows=rows))


def test_module_materialize_compiles_and_keeps_the_values(graph: fxinit.InitGraph) -> None:
    torch.manual_seed(0)
    m = fxinit.materialize(fxinit.trace_init(Fills), rng="portable", compile=True)
    _same(dict(m.named_parameters()), graph.materialize(rng="portable", compile=False))


class HalfChains(nn.Module):
    """Chains on bfloat16 and float16 fills whose numbers those dtypes cannot hold: eager
    rounds ``add``/``sub``'s number to the dtype first (torch 2.13) and every op's result."""

    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Parameter(torch.rand(10007, dtype=BF16) - 0.1)
        self.div_sub = nn.Parameter(torch.rand(10007, dtype=BF16) / 7.0 - 0.1)
        self.mul_add_mul = nn.Parameter((torch.randn(10007, dtype=torch.float16) * 0.3 + 0.1) * 1.7)
        self.int_add = nn.Parameter(torch.rand(10007, dtype=BF16) * 300 + 257)
        self.clamped = nn.Parameter(torch.randn(10007, dtype=BF16).mul(0.02).clamp(-0.03, 0.03).add(1 / 3))


def test_chains_on_half_dtypes_round_as_eager_ops_do() -> None:
    torch.manual_seed(0)
    graph = fxinit.init_graph(fxinit.trace_init(HalfChains))
    plan = graph.plan(rng="portable", compile=True)
    # every op runs inside a kernel, where Inductor keeps their roundings (torch 2.13 on)
    assert sum(len(k.chain) for k in plan.kernels.values()) == (11 if _keeps_roundings() else 0)
    _same(graph.materialize(rng="portable", compile=True), graph.materialize(rng="portable", compile=False))


def _keeps_roundings() -> bool:
    return compiled.inductor_keeps_roundings(torch.device("cpu"))


def test_an_inductor_that_drops_roundings_gets_no_chain_after_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's and 2.12's Inductor fold ``x.to(bfloat16).float()`` into ``x``: there a
    bfloat16 or float16 kernel ends at its rounding (its chain runs as torch ops), and a fill
    cast after it runs uncompiled; a float32 kernel keeps its chain."""
    monkeypatch.setattr(execute, "inductor_keeps_roundings", lambda device: False)
    torch.manual_seed(0)
    graph = fxinit.init_graph(fxinit.trace_init(HalfChains))
    plan = graph.plan(rng="portable", compile=True)
    assert len(plan.kernels) == 5 and not any(k.chain for k in plan.kernels.values())
    _same(graph.materialize(rng="portable", compile=True), graph.materialize(rng="portable", compile=False))
    torch.manual_seed(0)
    fills = fxinit.init_graph(fxinit.trace_init(Fills))
    kernels = fills.plan(rng="portable", compile=True, dtype=torch.float16).kernels.values()
    assert not any((k.chain or k.cast) for k in kernels if k.dtype != F32)
    assert any(k.cast == torch.float16 for k in kernels) and any(len(k.chain) == 2 for k in kernels)
    _same(fills.materialize(rng="portable", compile=True, dtype=torch.float16),
          fills.materialize(rng="portable", compile=False, dtype=torch.float16))


def test_a_compiled_kernel_with_other_bits_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each kernel torch.compile generates is checked against the torch ops it was compiled
    from before it fills anything: a compiler that rounds otherwise is refused by name."""
    def off_by_one_bit(kernel: compiled.Kernel):
        def fill(out: torch.Tensor, *args) -> None:
            compiled._kernel_function(kernel)(out, *args)
            out.view(torch.int32 if out.element_size() == 4 else torch.int16)[1::7] += 1
        return fill

    monkeypatch.setattr(compiled, "compiled", off_by_one_bit)
    monkeypatch.setattr(compiled, "_WARM", set())
    torch.manual_seed(0)
    with pytest.raises(fxinit.DeferredInitError, match=r"portable fill (uniform|normal) .*gives other bits"):
        fxinit.materialize(fxinit.trace_init(Fills), rng="portable", compile=True)


def _llama(layers: int) -> fxinit.InitGraph:
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300)
    torch.manual_seed(0)
    return fxinit.init_graph(fxinit.trace_init(LlamaForCausalLM, cfg))


def test_a_model_compiles_the_same_few_kernels_whatever_its_depth() -> None:
    shallow, deep = _llama(2), _llama(12)
    signatures = [{k.signature for k in g.plan(rng="portable", compile=True).kernels.values()} for g in (shallow, deep)]
    assert signatures[0] == signatures[1] and len(signatures[0]) == 1  # every fill: normal_ into float32
    assert len(deep.plan(rng="portable", compile=True).kernels) > 5 * len(shallow.plan(rng="portable", compile=True).kernels) // 2
    _same(shallow.materialize(rng="portable", compile=True), shallow.materialize(rng="portable"))
    compiled_before = compiled.STATS.kernels
    _same(deep.materialize(rng="portable", compile=True), deep.materialize(rng="portable"))
    assert compiled.STATS.kernels == compiled_before  # nothing new to compile for 12 layers


def test_compile_none_false_and_exact_mode(graph: fxinit.InitGraph) -> None:
    if portable_library() is not None:  # fxinit's C kernel beats Inductor's code on the CPU
        assert not graph.plan(rng="portable").kernels
    assert not graph.plan(rng="portable", compile=False).kernels
    assert not graph.plan(compile=True).kernels  # exact mode: torch's generators, nothing compiled
    assert graph.plan(rng="portable", compile=True).kernels


def test_compile_true_is_refused_where_torch_compile_cannot_generate_code(
        graph: fxinit.InitGraph, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execute, "compile_available", lambda device: "no C++ compiler")
    with pytest.raises(DeferredInitError, match="compile=True: torch.compile cannot generate kernels for cpu"):
        graph.materialize(rng="portable", compile=True)
    assert not graph.plan(rng="portable", compile=None).kernels


def test_where_compiling_off_the_main_thread_crashes_torch_a_worker_runs_the_torch_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's torch.compile crashes the process when the main thread compiles after
    another thread did: there a thread other than the main one compiles nothing, and runs
    the kernels as the torch ops they are made of (the same bits)."""
    monkeypatch.setattr(compiled, "_COMPILING_OFF_THE_MAIN_THREAD_CRASHES", True)
    monkeypatch.setattr(compiled, "_WARM", set())
    torch.manual_seed(0)
    graph = fxinit.init_graph(fxinit.trace_init(HalfChains))
    before = compiled.STATS.calls
    with ThreadPoolExecutor(1) as pool:
        off_main = pool.submit(graph.materialize, rng="portable", compile=True).result()
    assert compiled.STATS.calls == before and not compiled._WARM  # nothing compiled, nothing ran compiled
    _same(off_main, graph.materialize(rng="portable", compile=False))
