"""The public API, one entry point at a time, against eager construction."""

from __future__ import annotations

import sys

import pytest

import torch
import torch.nn as nn

import fxinit
from conftest import (
    assert_bits,
    assert_modules_equal,
    assert_same_as_eager,
    named_tensors,
    rng_state,
    same_bits,
    tie_partition,
)


class Block(nn.Module):
    def __init__(self, d: int = 4, tie: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, d, padding_idx=0)
        self.norm = nn.LayerNorm(d)
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 7, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        inv = 1.0 / (100 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv, persistent=False)


def _eager(*args, seed=0, **kw):
    torch.manual_seed(seed)
    return Block(*args, **kw)


def _traced(*args, seed=0, **kw):
    torch.manual_seed(seed)
    return fxinit.trace_init(Block, *args, **kw)


# ----------------------------------------------------------------------------- trace_init / deferred_init
def test_trace_init_args_kwargs_and_callables() -> None:
    assert_same_as_eager(Block, 6, tie=False, orders=("whole",))
    assert_same_as_eager(lambda: Block(d=2), orders=("whole",))

    def build(n):
        return nn.Sequential(*[Block() for _ in range(n)])

    assert_same_as_eager(build, 2, orders=("reverse",))


def test_deferred_init_is_trace_init() -> None:
    ref = _eager()
    torch.manual_seed(0)
    m = fxinit.deferred_init(Block)
    assert fxinit.is_deferred(m)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


def test_deferred_tensors_look_like_the_eager_ones() -> None:
    ref = _eager()
    m = _traced()
    for (_, n, t), (_, _, r) in zip(named_tensors(m), named_tensors(ref)):
        assert fxinit.is_deferred(t), n
        assert (t.shape, t.dtype, t.requires_grad) == (r.shape, r.dtype, r.requires_grad), n
        # documented: the intended device, as eager (torch.distributed alone sees meta), and
        # the repr says what it is
        assert t.device == r.device and not t.is_meta and t.is_cpu, n
        assert f"device='{r.device}'" in repr(t) and "meta" not in repr(t), n  # what t.device says
        assert repr(t).startswith("DeferredParameter(" if isinstance(r, nn.Parameter) else "DeferredTensor("), n
        assert isinstance(t, nn.Parameter) == isinstance(r, nn.Parameter), n
        repr(t)  # never touches data
    assert tie_partition(named_tensors(m)) == tie_partition(named_tensors(ref))


def test_is_deferred() -> None:
    m = _traced()
    assert fxinit.is_deferred(m) and fxinit.is_deferred(m.norm) and fxinit.is_deferred(m.norm.weight)
    fxinit.materialize(m.norm)
    assert not fxinit.is_deferred(m.norm) and not fxinit.is_deferred(m.norm.weight)
    assert fxinit.is_deferred(m)
    fxinit.materialize(m)
    assert not fxinit.is_deferred(m)
    assert not fxinit.is_deferred(torch.zeros(2))
    assert not fxinit.is_deferred(nn.Linear(2, 2))


# ----------------------------------------------------------------------------- materialize
def test_materialize_returns_its_argument_and_is_idempotent() -> None:
    ref = _eager()
    m = _traced()
    assert fxinit.materialize(m) is m
    assert fxinit.materialize(m) is m  # a second call is a no-op
    assert_modules_equal(m, ref)
    t = torch.ones(2)
    assert fxinit.materialize(t) is t
    with pytest.raises(TypeError):
        fxinit.materialize("not a module")


def test_materialize_each_tensor_and_each_module_in_any_order() -> None:
    ref = _eager(seed=4)
    m = _traced(seed=4)
    fxinit.materialize(m.inv_freq)
    fxinit.materialize(m.bn.running_var)
    fxinit.materialize(m.head)  # the tied weight, through its second owner
    assert not fxinit.is_deferred(m.emb.weight)
    fxinit.materialize(m.bn)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


class _Shared(nn.Module):
    """Plain layers (one of them tied: one object), and tensors a part of the model must bring
    along: a parameter over another module's storage, a tensor computed with autograd from a
    parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        self.a = nn.Linear(3, 3)
        self.b = nn.Module()
        self.b.row = nn.Parameter(self.a.weight.data[1])
        self.c = nn.Linear(3, 3)
        self.d = nn.Module()
        self.d.register_buffer("twice", self.c.weight * 2)
        self.e = nn.Linear(3, 3, bias=False)
        self.e.weight = self.plain[0].weight


@pytest.mark.parametrize("order", ["modules", "tensors"])
def test_a_part_of_the_model_brings_along_what_shares_with_it_and_nothing_else(
        order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Materializing module by module (or tensor by tensor) gives eager's values, storages
    and gradient paths. Only a part that shares a storage or a gradient path with the rest
    looks through the whole model for it: walking the whole model for every part made
    materializing a model part by part quadratic in its size."""
    companions = sys.modules["fxinit.companions"]
    torch.manual_seed(0)
    eager = _Shared()
    torch.manual_seed(0)
    m = fxinit.trace_init(_Shared)
    walked = []
    real_walk = companions.module_walk
    monkeypatch.setattr(companions, "module_walk", lambda mod: walked.append(mod) or real_walk(mod))
    if order == "modules":
        parts = [m.plain[1], m.plain[0], m.b, m.a, m.d, m.c, m.e]
    else:
        parts = [t for _, _, t in reversed(named_tensors(m))]
    for part in parts:
        whole_walks = sum(w is m for w in walked)
        fxinit.materialize(part)
        if any(part is x for x in [m.plain[0], m.plain[1], m.e, *m.plain.parameters()]):  # (tied: one object)
            assert sum(w is m for w in walked) == whole_walks, part
        elif part is m.b or part is m.b.row:  # it finds a.weight's storage, d.twice its gradient path
            assert sum(w is m for w in walked) == whole_walks + 1
    assert not fxinit.is_deferred(m)
    assert_modules_equal(m, eager)
    assert m.b.row.data_ptr() == m.a.weight[1].data_ptr() and m.e.weight is m.plain[0].weight
    assert type(m.d.twice.grad_fn) is type(eager.d.twice.grad_fn)
    m.d.twice.sum().backward()
    eager.d.twice.sum().backward()
    assert_bits(m.c.weight.grad, eager.c.weight.grad)


class _ParameterOfAComputedTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Module()
        self.b.copy = self.a.weight.clone()  # computed with autograd from a.weight: goes with it
        self.b.p = nn.Parameter(self.b.copy)  # over b.copy's memory: goes with b.copy


@pytest.mark.parametrize("first", ["a", "a.weight", "b", "b.p"])
def test_what_shares_memory_with_a_tensor_brought_along_comes_along_too(first: str) -> None:
    """``nn.Parameter(b)`` of a ``b = w.clone()``: materializing ``w`` (or its module) brings ``b``
    (its ``grad_fn`` holds ``w``) and must bring what shares ``b``'s memory as well; it left the
    parameter for a later call, over memory of its own, silently (found by the fuzzer)."""
    torch.manual_seed(0)
    eager = _ParameterOfAComputedTensor()
    torch.manual_seed(0)
    m = fxinit.trace_init(_ParameterOfAComputedTensor)
    fxinit.materialize(m.get_submodule(first) if first in ("a", "b") else m.get_parameter(first))
    fxinit.materialize(m)
    assert_modules_equal(m, eager)
    assert m.b.p.untyped_storage().data_ptr() == m.b.copy.untyped_storage().data_ptr()


def test_materialize_explicit_device_cpu() -> None:
    ref = _eager()
    m = _traced()
    fxinit.materialize(m, device="cpu")
    assert_modules_equal(m, ref)
    m = _traced()
    fxinit.materialize(m.norm, device=torch.device("cpu"))
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


def test_materialize_init_false_allocates_like_eager() -> None:
    ref = _eager()
    m = _traced()
    params = {n: t for _, n, t in named_tensors(m)}
    before = rng_state()
    fxinit.materialize(m, init=False)
    assert torch.equal(rng_state(), before)
    assert not fxinit.is_deferred(m)
    got, want = named_tensors(m), named_tensors(ref)
    assert [n for _, n, _ in got] == [n for _, n, _ in want]
    for (_, n, t), (_, _, r) in zip(got, want):
        assert t is params[n], n
        assert type(t) is type(r), n
        assert (t.shape, t.dtype, t.device, t.requires_grad) == (r.shape, r.dtype, r.device, r.requires_grad), n
    assert tie_partition(got) == tie_partition(want)


def test_materialize_does_not_touch_the_global_rng() -> None:
    m = _traced()
    torch.manual_seed(1234)
    before = rng_state()
    fxinit.materialize(m.head)
    fxinit.materialize(m)
    assert torch.equal(rng_state(), before)


def test_materialize_tensor() -> None:
    ref = _eager()
    m = _traced()
    w = m.norm.weight
    out = fxinit.materialize_tensor(m.emb.weight)
    assert out is m.emb.weight and out is m.head.weight
    assert_bits(out, ref.emb.weight, "emb.weight")
    assert w is m.norm.weight and fxinit.is_deferred(w)


# ----------------------------------------------------------------------------- materialize_module
def test_materialize_module_all() -> None:
    ref = _eager()
    m = _traced()
    assert fxinit.materialize_module(m) is m
    assert_modules_equal(m, ref)


def test_materialize_module_buffers_only() -> None:
    ref = _eager()
    m = _traced()
    fxinit.materialize_module(m, buffers_only=True)
    for n, b in m.named_buffers():
        assert not fxinit.is_deferred(b), n
    for n, p in m.named_parameters():
        assert fxinit.is_deferred(p), n
    for (n, b), (_, r) in zip(m.named_buffers(), ref.named_buffers()):
        assert_bits(b, r, n)
    fxinit.materialize_module(m)
    assert_modules_equal(m, ref)


def test_materialize_module_check_fn() -> None:
    ref = _eager()
    m = _traced()
    seen = []

    def check(mod):
        seen.append(type(mod).__name__)
        return not isinstance(mod, nn.LayerNorm)

    fxinit.materialize_module(m, check_fn=check)
    assert "LayerNorm" in seen
    assert fxinit.is_deferred(m.norm.weight) and fxinit.is_deferred(m.norm.bias)
    assert not fxinit.is_deferred(m.bn) and not fxinit.is_deferred(m.emb)
    assert_bits(m.bn.weight, ref.bn.weight, "bn.weight")
    fxinit.materialize_module(m)
    assert_modules_equal(m, ref)


def test_materialize_module_check_fn_false_at_root_does_nothing() -> None:
    m = _traced()
    fxinit.materialize_module(m, check_fn=lambda mod: False)
    assert all(fxinit.is_deferred(t) for _, _, t in named_tensors(m))


# ----------------------------------------------------------------------------- init_graph
def test_init_graph_materialize_equals_eager_state() -> None:
    ref = _eager(seed=2)
    m = _traced(seed=2)
    g = fxinit.init_graph(m)
    assert isinstance(g.graph, torch.fx.Graph)
    want = {n: t for _, n, t in named_tensors(ref)}
    assert set(g.outputs) == set(want)
    assert all(isinstance(node, torch.fx.Node) for node in g.outputs.values())
    assert sorted(sorted(t) for t in g.ties) == [["emb.weight", "head.weight"]]
    torch.manual_seed(99)
    before = rng_state()
    vals = g.materialize()
    assert torch.equal(rng_state(), before)
    assert set(vals) == set(want)
    for name, r in want.items():
        assert_bits(vals[name], r, name)
    sd = ref.state_dict()
    for k in sd:
        assert_bits(vals[k], sd[k], k)
    assert fxinit.is_deferred(m), "init_graph().materialize() must not touch the module"


def test_init_graph_materialize_subset_and_device() -> None:
    ref = _eager()
    g = fxinit.init_graph(_traced())
    vals = g.materialize(["bn.running_var", "head.weight"], device="cpu")
    assert set(vals) == {"bn.running_var", "head.weight"}
    assert_bits(vals["head.weight"], ref.head.weight, "head.weight")
    assert_bits(vals["bn.running_var"], ref.bn.running_var, "bn.running_var")
    with pytest.raises(KeyError):
        g.materialize(["nope"])


def test_init_graph_of_submodule_and_after_partial_materialize() -> None:
    ref = _eager()
    m = _traced()
    g = fxinit.init_graph(m.bn)
    assert set(g.outputs) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    vals = g.materialize()
    assert_bits(vals["weight"], ref.bn.weight, "bn.weight")
    fxinit.materialize(m.norm)
    g2 = fxinit.init_graph(m)
    assert "norm.weight" not in g2.outputs
    assert_bits(g2.materialize(["emb.weight"])["emb.weight"], ref.emb.weight, "emb.weight")


def test_init_graph_carries_a_module_another_trace_materialized() -> None:
    """What this trace materialized is left out of its init graph (the part still to do);
    a module materialized by another trace and handed to the constructor is data here, carried
    like data loaded in ``__init__`` (it was left out: fxinit's mark did not say which trace)."""
    class Wrapper(nn.Module):
        def __init__(self, backbone: nn.Module) -> None:
            super().__init__()
            self.backbone = backbone
            self.head = nn.Linear(3, 2)

    torch.manual_seed(0)
    backbone = fxinit.materialize(fxinit.trace_init(nn.Linear, 3, 3))
    m = fxinit.trace_init(Wrapper, backbone)
    fxinit.materialize(m.head.bias)
    g = fxinit.init_graph(m)
    assert sorted(g.outputs) == ["backbone.bias", "backbone.weight", "head.weight"]
    assert_bits(g.materialize(["backbone.weight"])["backbone.weight"], backbone.weight, "backbone.weight")


def test_init_graph_of_a_real_module_raises() -> None:
    with pytest.raises((ValueError, fxinit.DeferredInitError)):
        fxinit.init_graph(nn.Linear(2, 2))


# ----------------------------------------------------------------------------- meta_init
def test_meta_init_seed_example() -> None:
    with fxinit.meta_init():
        t1 = torch.ones(3)
        t2 = t1 + 2
    assert fxinit.is_deferred(t1) and fxinit.is_deferred(t2)
    fxinit.materialize(t1, keep_cache=True)
    fxinit.materialize(t2)
    assert torch.equal(t1, torch.ones(3))
    assert torch.equal(t2, torch.tensor([3.0, 3.0, 3.0]))


def test_meta_init_cache_is_cleared_without_keep_cache() -> None:
    with fxinit.meta_init():
        t1 = torch.ones(3)
        t2 = t1 * 4
    fxinit.materialize(t1)  # keep_cache=False: the cache goes
    with pytest.raises(fxinit.DeferredInitError):
        fxinit.materialize(t2)
    assert fxinit.is_deferred(t2)


def test_clear_meta_init_cache() -> None:
    with fxinit.meta_init():
        t = torch.arange(3.0)
    fxinit.clear_meta_init_cache()
    with pytest.raises(fxinit.DeferredInitError):
        fxinit.materialize(t)


def test_meta_init_overrides_explicit_device() -> None:
    with fxinit.meta_init():
        t = torch.ones(2, 2, device="cpu")
        lin = nn.Linear(2, 2, device="cpu")
    assert fxinit.is_deferred(t) and fxinit.is_deferred(lin.weight)
    fxinit.materialize(t, keep_cache=True)
    assert t.device.type == "cpu" and torch.equal(t, torch.ones(2, 2))


def test_meta_init_module_equals_eager_and_keeps_rng() -> None:
    torch.manual_seed(0)
    ref = Block()
    eager_rng = rng_state()
    torch.manual_seed(0)
    with fxinit.meta_init():
        m = Block()
    assert torch.equal(rng_state(), eager_rng)
    assert fxinit.is_deferred(m)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


def test_is_meta_init() -> None:
    seen = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            seen.append(fxinit.is_meta_init())
            self.w = nn.Parameter(torch.randn(2))
            if not fxinit.is_meta_init():
                self.checked = float(self.w.sum())  # only possible with real data
            else:
                self.checked = None

    assert not fxinit.is_meta_init()
    Probe()
    fxinit.trace_init(Probe)
    with fxinit.meta_init():
        assert fxinit.is_meta_init()
        Probe()
    assert not fxinit.is_meta_init()
    assert seen == [False, True, True]


def test_is_meta_init_branch_values_still_equal_eager() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(5))
            if not fxinit.is_meta_init():
                assert float(self.w.abs().sum()) >= 0  # a sanity check that needs data

    assert_same_as_eager(Branchy)


# ----------------------------------------------------------------------------- the oracle can fail
class Cheats(nn.Module):
    """Differs from eager only when traced: the oracle must notice."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        traced = fxinit.is_meta_init()
        if how == "value" and traced:
            with torch.no_grad():
                self.a.bias.add_(1e-7)
        if how == "rng" and traced:
            torch.randn(1)
        if how == "tie" and not traced:
            self.b.weight = self.a.weight
        if how == "dtype" and traced:
            self.b.double()
        if how == "param_type" and traced:
            w = self.b.bias
            del self.b.bias
            self.b.register_buffer("bias", w.detach())


@pytest.mark.parametrize("how", ["value", "rng", "tie", "dtype", "param_type"])
def test_oracle_detects_differences(how: str) -> None:
    with pytest.raises(pytest.fail.Exception):
        assert_same_as_eager(Cheats, how, seeds=(0,), orders=("whole",))
    assert_same_as_eager(Cheats, "none", seeds=(0,), orders=("whole",))


def test_same_bits_distinguishes_signed_zero_and_nan_payloads() -> None:
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert same_bits(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not same_bits(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))


class ElementwiseEquality(nn.Module):
    """tensordict's ``TensorDictParams`` (in every torchrl loss module): ``==`` compares element
    by element, and the result's truth value raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def __eq__(self, other: object) -> torch.Tensor:  # type: ignore[override]
        return torch.tensor([True, False])

    __hash__ = nn.Module.__hash__


def test_modules_that_define_equality_otherwise() -> None:
    """fxinit's own maps of modules compared them with ``==`` (found by a torchrl sweep):
    materialize, check and a forward after a partial materialize raised."""
    def holding() -> nn.Module:
        m = nn.Module()
        m.inner = ElementwiseEquality()
        m.other = nn.Linear(2, 2)
        return m

    for build in (ElementwiseEquality, holding):
        assert_same_as_eager(build, seeds=(0,))
        assert fxinit.check(build).ok
    torch.manual_seed(0)
    m = fxinit.trace_init(ElementwiseEquality)
    fxinit.materialize(m.lin.weight)
    fxinit.materialize(m.lin.bias)
    m.lin(torch.ones(2))  # the guard comes off the materialized module
