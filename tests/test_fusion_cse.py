"""Cast fusion (chunked fill-then-cast, ``materialize(dtype=)``), CSE and in-place chains:
each pass alone on the graph, and through materialization, which must stay bitwise equal
to eager construction (followed by ``Module.to(dtype)`` where a dtype is asked for)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import fxinit
from fxinit import execute
from fxinit.backends.exact import ExactSampler
from fxinit.backends.interpreter import Interpreter
from fxinit.numerics import Settings
from fxinit.rng.pieces import CHUNK, chunk_bounds
from fxinit.passes.cast_fusion import fused_casts
from fxinit.passes.cse import common_subexpressions
from fxinit.passes.inplace import in_place_chains
from fxinit.rng import RngSnapshot
from tests.conftest import assert_same_as_eager, kernel_takes

BIG = 2 * CHUNK + 37  # large enough to be chunked, not a multiple of 16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def _assert_state_dicts_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(_bits(sa[k]), _bits(sb[k])), k


def _plan_parts(model: nn.Module):
    g = fxinit.init_graph(model)
    nodes = g.required_nodes(list(g.outputs))
    return g, nodes, set(g.outputs.values())


class CastInInit(nn.Module):
    """``.to(half precision)`` at the end of a random init chain, in ``__init__``."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.empty(BIG // 37, 37)
        w.normal_(0, 0.02)
        self.w = nn.Parameter(w.to(torch.bfloat16))
        u = torch.empty(BIG)
        nn.init.uniform_(u, -1, 1)
        self.register_buffer("u", u.to(torch.float16))
        self.small = nn.Parameter(torch.empty(100).normal_().to(torch.bfloat16))


def test_fill_then_cast_in_init_is_fused_and_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(CastInInit)
    g, nodes, keep = _plan_parts(m)
    plans = fused_casts(nodes, keep)
    assert sorted(str(p.dtype) for p in plans.values()) == ["torch.bfloat16", "torch.bfloat16", "torch.float16"]
    calls = []
    real = Interpreter.fused_cast
    monkeypatch.setattr(Interpreter, "fused_cast", lambda self, *a: calls.append(a) or real(self, *a))
    assert_same_as_eager(CastInInit)
    assert calls  # the two large ones ran chunked (the small one runs unfused)


@pytest.mark.parametrize("op,args,dtype", [
    (torch.ops.aten.normal_.default, (0.0, 0.02), torch.float32),
    (torch.ops.aten.normal_.default, (1.0, 3.0), torch.float64),
    (torch.ops.aten.uniform_.default, (-0.5, 0.5), torch.float32),
    (torch.ops.aten.uniform_.default, (0.0, 1.0), torch.bfloat16),
])
@pytest.mark.parametrize("n", [2 * CHUNK, BIG, 3 * CHUNK + 15])
@pytest.mark.parametrize("native", [True, False], ids=["rng.fills", "torch"])
def test_chunked_fill_equals_whole_fill(op, args, dtype, n, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import fxinit.backends.exact as exact_backend

    if not native:  # torch's kernel in chunks, as where rng.fills failed its check
        monkeypatch.setattr(exact_backend, "native_fill", lambda *a, **k: False)

    gen = torch.Generator().manual_seed(n)
    snap = RngSnapshot(device="cpu", state=gen.get_state())
    whole = torch.empty(n, dtype=dtype)
    op(whole, *args, generator=gen)
    node = torch.fx.Graph().call_function(op, (None, *args))
    node.meta["generators"] = {"gen": "g"}
    got = torch.full((n,), float("nan"), dtype=dtype)
    seen = []
    real = exact_backend.chunk_bounds
    monkeypatch.setattr(exact_backend, "chunk_bounds", lambda *a: seen.extend(real(*a)) or real(*a))
    ExactSampler({"g": snap}).fill_chunks(node, (got, *args), {})
    normal = op is torch.ops.aten.normal_.default
    takes = native and kernel_takes("normal" if normal else "uniform", dtype)  # (else it declines: torch in chunks)
    assert seen == ([] if takes else chunk_bounds(n, normal))
    assert all(hi - lo <= CHUNK + 32 for lo, hi in seen)
    assert torch.equal(_bits(got), _bits(whole))


def test_chunks_keep_the_normal_tail_block_whole() -> None:
    n = 2 * CHUNK + 5
    bounds = chunk_bounds(n, blocks=True)
    assert bounds[-1][1] == n and bounds[-1][1] - bounds[-1][0] >= 16
    assert all(lo % 16 == 0 for lo, _ in bounds)
    assert chunk_bounds(n, blocks=False)[-1] == (2 * CHUNK, n)


LLAMA = dict(hidden_size=256, intermediate_size=2304, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=2100, pad_token_id=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_materialize_dtype_equals_eager_then_module_to(dtype: torch.dtype) -> None:
    cfg = LlamaConfig(**LLAMA)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).to(dtype)
    torch.manual_seed(0)
    m = fxinit.trace_init(LlamaForCausalLM, cfg)
    g = fxinit.init_graph(m)
    assert len(g.plan(dtype=dtype).fused_casts) >= 4  # the large projections and the embedding fill in chunks
    fxinit.materialize(m, dtype=dtype)
    _assert_state_dicts_equal(ref, m)
    assert m.model.embed_tokens.weight.dtype == dtype and isinstance(m.model.embed_tokens.weight, nn.Parameter)


def test_materialize_dtype_portable_is_the_cast_of_full_precision_portable() -> None:
    cfg = LlamaConfig(**LLAMA)
    torch.manual_seed(0)
    full = fxinit.init_graph(fxinit.trace_init(LlamaForCausalLM, cfg)).materialize(rng="portable")
    torch.manual_seed(0)
    m = fxinit.trace_init(LlamaForCausalLM, cfg)
    fxinit.materialize(m, dtype=torch.bfloat16, rng="portable")
    got = {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers(remove_duplicate=False))}
    for name, value in full.items():
        assert torch.equal(_bits(got[name]), _bits(value.to(torch.bfloat16))), name


class ReadAfterFinal(nn.Module):
    """A buffer computed from a parameter after the parameter is final: the cast of the
    parameter must wait until the buffer has read the full-precision value."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 3)
        self.register_buffer("scaled", self.w.detach() * 1.0001)
        self.register_buffer("steps", torch.arange(10))  # integer: never cast
        self.register_buffer("freqs", torch.polar(torch.ones(8), torch.arange(8.0)))  # complex: cast, as Module.to does


@pytest.mark.filterwarnings("ignore:Casting complex values to real")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.complex128])
def test_requested_dtype_waits_for_the_last_reader_and_follows_module_to(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ref = ReadAfterFinal().to(dtype)
    torch.manual_seed(0)
    m = fxinit.materialize(fxinit.trace_init(ReadAfterFinal), dtype=dtype)
    _assert_state_dicts_equal(ref, m)
    assert m.steps.dtype == torch.int64 and m.freqs.dtype == dtype


def test_graph_and_artifact_materialize_with_dtype(tmp_path) -> None:
    torch.manual_seed(0)
    ref = CastInInit().to(torch.float16)
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(CastInInit))
    g.save(tmp_path / "g.pt")
    for graph in (g, fxinit.load_graph(tmp_path / "g.pt")):
        out = graph.materialize(dtype=torch.float16)
        for name, value in ref.state_dict().items():
            assert torch.equal(_bits(out[name]), _bits(value)), name
    with pytest.raises(TypeError, match="floating-point or complex"):
        g.materialize(dtype=torch.int32)
    with pytest.raises(TypeError, match="floating-point or complex"):
        fxinit.materialize(fxinit.trace_init(CastInInit), dtype=torch.int8)


# ------------------------------------------------------------------------------- CSE
class PerLayerConstants(nn.Module):
    """Every layer recomputes the same rotary frequencies and causal mask."""

    def __init__(self, layers: int = 3, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            layer.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
            layer.register_buffer("mask", torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16))
            layer.proj = nn.Linear(dim, dim)
            self.layers.append(layer)


def test_cse_reuses_repeated_constants_and_outputs_keep_own_storage() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(PerLayerConstants)
    g, nodes, keep = _plan_parts(m)
    shared = common_subexpressions(nodes, keep)
    assert len(shared) >= 2 * 6  # two more layers' arange, cast, div, pow, reciprocal... and masks
    assert all(first.meta["pos"] < dup.meta["pos"] for dup, (first, _) in shared.items())
    assert all(copy for dup, (_, copy) in shared.items() if dup in keep)  # outputs get storages of their own
    assert_same_as_eager(PerLayerConstants)
    fxinit.materialize(m)
    ptrs = {b.data_ptr() for layer in m.layers for b in (layer.inv_freq, layer.mask)}
    assert len(ptrs) == 6  # no two buffers share memory, as in eager
    m.layers[0].inv_freq.add_(1)
    assert not torch.equal(m.layers[0].inv_freq, m.layers[1].inv_freq)


class ChangedBetween(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        base = torch.arange(8).float()
        self.register_buffer("a", base * 2)
        base.add_(1)  # same node computes ``base * 2`` again below, on changed contents
        self.register_buffer("b", base * 2)
        self.register_buffer("i", torch.full((4,), 1))
        self.register_buffer("f", torch.full((4,), 1.0))
        self.register_buffer("t", torch.full((4,), True))


def test_cse_respects_writes_in_between_and_scalar_types() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(ChangedBetween)
    g, nodes, keep = _plan_parts(m)
    shared = common_subexpressions(nodes, keep)
    assert not any(n.target is torch.ops.aten.mul.Tensor for n in shared)
    assert not any(n.target is torch.ops.aten.full.default for n in shared)
    assert_same_as_eager(ChangedBetween)


# ---------------------------------------------------------------------- in-place chains
class Chains(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(64, 64) * 0.02 + 1)           # in place twice
        self.b = nn.Parameter(torch.randn(8, 1) * torch.ones(1, 8))     # broadcasts: not in place
        self.c = nn.Parameter(torch.arange(16) * 0.5)                   # int64 -> float: not in place
        t = torch.randn(32)
        self.d = nn.Parameter(t * 2)
        self.register_buffer("e", t.clone())                            # t is read again: not in place


def test_element_wise_chains_run_in_place_only_where_exact() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(Chains)
    g, nodes, keep = _plan_parts(m)
    chains = in_place_chains(nodes, keep, common_subexpressions(nodes, keep))
    shapes = sorted((tuple(n.meta["spec"].shape), str(op)) for n, op in chains.items())
    assert shapes == [((64, 64), "aten.add_.Tensor"), ((64, 64), "aten.mul_.Tensor")]
    assert_same_as_eager(Chains)


def test_passes_keep_a_transformers_model_exact_and_report_stats() -> None:
    cfg = LlamaConfig(**LLAMA)
    assert_same_as_eager(LlamaForCausalLM, cfg, seeds=(0,))
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(LlamaForCausalLM, cfg))
    s = g.stats(dtype=torch.bfloat16)
    assert s["fused_casts"] >= 4
    assert s["bytes_allocated"] < s["bytes_allocated_captured"]
    assert math.isclose(s["output_bytes_in_dtype"], s["output_bytes"] / 2, rel_tol=0.01)


def test_parallel_runs_keep_a_duplicate_with_the_value_it_reuses() -> None:
    from fxinit.passes import independent_groups

    torch.manual_seed(0)
    m = fxinit.trace_init(PerLayerConstants)
    g, nodes, keep = _plan_parts(m)
    shared = common_subexpressions(nodes, keep)
    groups = independent_groups(nodes, [(d, f) for d, (f, _) in shared.items()])
    where = {n: i for i, grp in enumerate(groups) for n in grp}
    assert all(where[d] == where[f] for d, (f, _) in shared.items())
    assert len(groups) > 1  # the Linear layers still run on their own
    plan = g.plan()
    assert plan.groups == groups
    serial = Interpreter(plan, g.constants, ExactSampler(g.snapshots), Settings(g.default_dtype, g.numerics)).run()  # program order
    parallel = execute.run(g, plan, workers=2)
    assert all(torch.equal(_bits(serial[k]), _bits(parallel[k])) for k in keep)


class BigFill(nn.Module):
    def __init__(self, op: str, n: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False)
        kind, args = _FILLS[op]
        getattr(self.w.data, kind)(*args)
        self.after = nn.Parameter(torch.empty(1000, dtype=dtype).normal_())  # the generator must end right


_FILLS = {"normal": ("normal_", (0.5, 2.0)), "uniform": ("uniform_", (-3.0, 3.0)), "bernoulli": ("bernoulli_", (0.3,)),
          "exponential": ("exponential_", (2.0,)), "random": ("random_", (0, 200)), "cauchy": ("cauchy_", ()),
          "log_normal": ("log_normal_", ()), "geometric": ("geometric_", (0.2,))}


@pytest.mark.parametrize("op", sorted(_FILLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_large_random_fills_run_in_cache_sized_pieces_with_the_bits_of_one_call(op: str, dtype: torch.dtype) -> None:
    assert_same_as_eager(BigFill, op, 2 * CHUNK + 5, dtype, seeds=(0,), orders=("whole",))
    assert_same_as_eager(BigFill, op, 3 * CHUNK, dtype, seeds=(1,), orders=("whole",))


def test_normal_fills_are_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxinit.backends.exact as exact_backend

    pieces = []
    real = exact_backend.chunk_bounds
    monkeypatch.setattr(exact_backend, "native_fill", lambda *a, **k: False)  # torch's kernel, in chunks
    monkeypatch.setattr(exact_backend, "chunk_bounds", lambda n, blocks: pieces.append(n) or real(n, blocks))
    assert_same_as_eager(BigFill, "normal", 2 * CHUNK + 5, torch.float32, seeds=(0,), orders=("whole",))
    assert 2 * CHUNK + 5 in pieces


def _arch(name: str):
    import transformers

    configs = {
        "gpt2": lambda: transformers.GPT2Config(n_embd=512, n_layer=2, n_head=8, vocab_size=1000, n_positions=300),
        "bert": lambda: transformers.BertConfig(hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                                                intermediate_size=600, vocab_size=1000, max_position_embeddings=300),
        "t5": lambda: transformers.T5Config(d_model=512, d_ff=600, num_layers=2, num_heads=8, vocab_size=1000,
                                            d_kv=64),
        "mixtral": lambda: transformers.MixtralConfig(hidden_size=512, intermediate_size=600, num_hidden_layers=2,
                                                      num_attention_heads=8, num_key_value_heads=4,
                                                      num_local_experts=2, vocab_size=1000),
    }
    cfg = configs[name]()
    return lambda: transformers.AutoModel.from_config(cfg)


@pytest.mark.parametrize("name", ["gpt2", "bert", "t5", "mixtral"])
def test_transformers_models_large_enough_to_chunk_stay_exact(name: str) -> None:
    """Tiny corpus configs are below the chunking threshold; these are not."""
    build = _arch(name)
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(build))
    assert g.stats(dtype=torch.bfloat16)["fused_casts"] >= 2
    assert_same_as_eager(build, seeds=(0,), orders=("whole", "reverse"))
    torch.manual_seed(1)
    ref = build().to(torch.bfloat16)
    torch.manual_seed(1)
    m = fxinit.materialize(fxinit.trace_init(build), dtype=torch.bfloat16)
    _assert_state_dicts_equal(ref, m)
