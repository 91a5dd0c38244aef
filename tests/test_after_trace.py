"""Work on a traced model between trace and materialize (optimizers, deep copies, ties, parametrizations,
reinits, patched factories), each against eager construction bit for bit."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune as prune
from torch.nn.utils import parametrizations as P

import fxinit
from conftest import (
    assert_bits,
    assert_modules_equal,
    assert_same_as_eager,
    built_both,
    materialize_in_order,
    named_tensors,
    rng_state,
    same_bits,
    tie_partition,
)
from test_traps import KeepsGenerator, TiedLM, _x


def _train_step(m: nn.Module, opt_cls, **opt_kw):
    opt = opt_cls(m.parameters(), **opt_kw)
    return opt


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adam, {"lr": 0.01})],
                         ids=["SGD", "Adam"])
def test_optimizer_created_on_deferred_params(opt_cls, kw) -> None:
    def build():
        return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2))

    torch.manual_seed(0)
    ref = build()
    ref_opt = opt_cls(ref.parameters(), **kw)
    torch.manual_seed(0)
    m = fxinit.trace_init(build)
    opt = opt_cls(m.parameters(), **kw)  # before materialize
    params_before = list(m.parameters())
    fxinit.materialize(m)
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], m.parameters()))
    assert all(p is q for p, q in zip(params_before, m.parameters()))
    for model, o in ((ref, ref_opt), (m, opt)):
        for _ in range(2):
            o.zero_grad()
            model(_x(3, 4)).square().sum().backward()
            o.step()
    assert_modules_equal(m, ref)


def test_deepcopy_of_deferred_model() -> None:
    torch.manual_seed(0)
    ref = TiedLM()
    torch.manual_seed(0)
    m = fxinit.trace_init(TiedLM)
    m2 = copy.deepcopy(m)
    assert fxinit.is_deferred(m2)
    assert m2.head.weight is m2.emb.weight
    assert m2.emb.weight is not m.emb.weight
    fxinit.materialize(m2.head)
    fxinit.materialize(m2)
    assert fxinit.is_deferred(m)
    fxinit.materialize(m)
    assert_modules_equal(m2, ref)
    assert_modules_equal(m, ref)
    assert m.emb.weight.data_ptr() != m2.emb.weight.data_ptr()


def test_two_traces_in_a_row_without_reseeding() -> None:
    torch.manual_seed(0)
    ref1 = TiedLM()
    ref2 = TiedLM()
    eager_rng = rng_state()
    torch.manual_seed(0)
    m1 = fxinit.trace_init(TiedLM)
    m2 = fxinit.trace_init(TiedLM)
    assert torch.equal(rng_state(), eager_rng)
    fxinit.materialize(m2)  # the second one first
    fxinit.materialize(m1)
    assert_modules_equal(m1, ref1)
    assert_modules_equal(m2, ref2)
    assert not same_bits(m1.body.weight, m2.body.weight)


def test_two_traces_with_reseeding_are_equal() -> None:
    torch.manual_seed(3)
    ref = TiedLM()
    torch.manual_seed(3)
    m1 = fxinit.trace_init(TiedLM)
    torch.manual_seed(3)
    m2 = fxinit.trace_init(TiedLM)
    fxinit.materialize(m1)
    fxinit.materialize(m2)
    assert_modules_equal(m1, ref)
    assert_modules_equal(m2, ref)


def test_eager_work_between_trace_and_materialize() -> None:
    torch.manual_seed(0)
    ref = TiedLM()
    ref_real = torch.randn(5)
    torch.manual_seed(0)
    m = fxinit.trace_init(TiedLM)
    real = torch.randn(5)  # draws where eager would have drawn after construction
    assert_bits(real, ref_real, "real tensor drawn after trace")
    torch.manual_seed(77)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


def test_submodule_shared_by_two_parents() -> None:
    class Parent(nn.Module):
        def __init__(self, shared: nn.Module) -> None:
            super().__init__()
            self.own = nn.Linear(3, 3)
            self.shared = shared

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = nn.Linear(3, 3)
            self.p1 = Parent(shared)
            self.p2 = Parent(shared)

    torch.manual_seed(0)
    ref = Root()
    torch.manual_seed(0)
    m = fxinit.trace_init(Root)
    fxinit.materialize(m.p1.shared)
    assert not fxinit.is_deferred(m.p2.shared)
    assert m.p2.shared.weight is m.p1.shared.weight
    assert fxinit.is_deferred(m.p1.own.weight) and fxinit.is_deferred(m.p2.own.weight)
    fxinit.materialize(m.p2)
    assert fxinit.is_deferred(m.p1.own.weight)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


def _recorded(post):
    """Run ``post`` on the fxinit model inside ``fxinit.recording`` (and plainly on the eager one):
    the documented way for post-trace code that builds tensors on a parameter's device."""

    def run(m):
        ctx = fxinit.recording(m) if fxinit.is_deferred(m) else contextlib.nullcontext()
        with ctx:
            post(m)

    return run


def test_parametrization_registered_after_trace() -> None:
    assert_same_as_eager(lambda: nn.Linear(5, 4), post=lambda m: P.spectral_norm(m),
                         forward=lambda m: m.eval()(_x(2, 5)))
    assert_same_as_eager(lambda: nn.Linear(4, 4), post=_recorded(lambda m: P.orthogonal(m)),
                         forward=lambda m: m.weight)


def test_parametrization_building_tensors_after_trace_needs_no_wrapper() -> None:
    """Registered after the trace, with nothing around it: the parametrization's helpers are
    built on the weight's intended device (real tensors), its init is recorded."""
    assert_same_as_eager(lambda: nn.Linear(4, 4), post=lambda m: P.orthogonal(m), forward=lambda m: m.weight)
    assert_same_as_eager(lambda: nn.Linear(4, 5), post=lambda m: P.spectral_norm(m),
                         forward=lambda m: m.eval()(_x(2, 4)))


def test_tensors_built_on_meta_by_torch_distributed_after_the_trace_are_refused() -> None:
    """A plain meta tensor nothing recorded, reachable from the model: materialize refuses
    before any work, naming it, instead of returning a meta tensor as if materialized."""
    m = fxinit.trace_init(nn.Linear, 4, 4)
    m.register_buffer("stale", torch.empty(3, device="meta"))
    with pytest.raises(fxinit.DeferredInitError, match="plain meta tensors.*stale"):
        fxinit.materialize(m)
    assert fxinit.is_deferred(m.weight)


def test_reinit_after_trace_with_tensors_made_on_the_parameters_device() -> None:
    """Re-init code often builds helper tensors with ``device=p.device``; eager builds them on
    the CPU. After the trace, a deferred parameter reports its intended device to code outside
    torch, so the helpers are real tensors, computed now from the real generator, with or
    without ``recording``."""

    def post(m):
        with torch.no_grad():
            w = m.weight
            w.copy_(torch.randn(w.shape, device=w.device, dtype=w.dtype) * 0.1)
            m.bias.copy_(torch.arange(m.bias.numel(), device=m.bias.device, dtype=m.bias.dtype))

    assert_same_as_eager(lambda: nn.Linear(4, 3), post=_recorded(post))
    assert_same_as_eager(lambda: nn.Linear(4, 3), post=post)


def test_generator_attribute_reused_after_trace() -> None:
    """The generator kept by the module is used again by a re-init after trace."""

    def post(m):
        nn.init.normal_(m.v, generator=m.g)
        nn.init.kaiming_uniform_(m.w, generator=m.g)

    assert_same_as_eager(KeepsGenerator, post=post)


def test_parameter_identity_kept_while_an_autograd_graph_references_it() -> None:
    """A tensor computed from a deferred parameter (with grad) is alive when materializing.

    ``torch.utils.swap_tensors`` cannot swap a tensor that a live autograd graph saved, so
    fxinit cannot keep that parameter's identity: it warns, puts the (correct) value in the
    module, and the old object stays deferred. Once the graph is gone, identity is kept.
    """
    torch.manual_seed(0)
    ref = nn.Linear(3, 2)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 3, 2)
    w = m.weight
    scaled = m.weight * m.weight  # the autograd graph saves the parameter itself
    with pytest.warns(UserWarning, match="could not swap"):
        fxinit.materialize(m)
    assert m.weight is not w and fxinit.is_deferred(w)
    assert_bits(m.weight, ref.weight, "weight")
    del scaled

    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 3, 2)
    w = m.weight
    scaled = m.weight * m.weight
    del scaled
    fxinit.materialize(m)
    assert m.weight is w and not fxinit.is_deferred(w)
    assert_bits(w, ref.weight, "weight")


def test_attributes_of_parameters_survive_materialize() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 3, 2)
    m.weight._is_hf_initialized = True
    m.bias.custom = {"x": 1}
    w = m.weight
    fxinit.materialize(m)
    assert w is m.weight and type(w) is nn.Parameter
    assert m.weight._is_hf_initialized is True
    assert m.bias.custom == {"x": 1}


def test_named_tensor_order_and_ties_visible_before_materialize() -> None:
    torch.manual_seed(0)
    ref = TiedLM()
    m = fxinit.trace_init(TiedLM)
    assert [n for _, n, _ in named_tensors(m)] == [n for _, n, _ in named_tensors(ref)]
    assert tie_partition(named_tensors(m)) == tie_partition(named_tensors(ref))


_FACTORY_NAMES = ("empty", "empty_strided", "zeros", "ones", "full", "tensor", "arange", "as_tensor")


class _PatchesFactories(nn.Module):
    """Replaces torch's factories while it builds (llm-foundry's and older accelerate's
    ``init_empty_weights(include_buffers=True)`` force ``device="meta"`` so; profilers count)."""

    def __init__(self, force_meta: bool) -> None:
        super().__init__()
        self.calls: list[str] = []
        originals = {name: getattr(torch, name) for name in _FACTORY_NAMES}

        def patched(name: str):  # noqa: ANN202
            def factory(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                self.calls.append(name)
                if force_meta and name in ("empty", "zeros", "ones", "full"):
                    kwargs["device"] = "meta"
                return originals[name](*args, **kwargs)
            return factory

        for name in _FACTORY_NAMES:
            setattr(torch, name, patched(name))
        try:
            self.lin = nn.Linear(3, 3)
            self.register_buffer("scale", torch.ones(3))
            if not force_meta:  # (values to read: fxinit computes them with factories of its own)
                self.width = int(self.lin.weight.abs().sum() > 1) + 2
                self.register_buffer("picked", torch.tensor([self.lin.bias[0], self.lin.bias[2]]))
                self.extra = nn.Parameter(torch.randn(self.width))
        finally:
            for name, original in originals.items():
                setattr(torch, name, original)


@pytest.mark.parametrize("force_meta", [False, True])
def test_factories_a_constructor_patches_are_its_own(force_meta: bool) -> None:
    """Found by a sweep of llm-foundry: fxinit's own ``torch.empty`` calls while recording went
    to the constructor's replacement, which put them on meta (a crash where eager builds). (The
    constructor's own calls are eager's; torch's Python meta kernels, which the capture runs
    where eager's CPU runs C++, call some more.)"""
    torch.manual_seed(0)
    eager = _PatchesFactories(force_meta)
    torch.manual_seed(0)
    m = fxinit.trace_init(_PatchesFactories, force_meta)
    fxinit.materialize(m)
    if force_meta:  # no values, in eager either
        layout = lambda mod: [(n, t.device, t.shape, t.dtype) for n, t in mod.state_dict().items()]  # noqa: E731
        assert layout(m) == layout(eager) and all(t.is_meta for t in m.state_dict().values())
    else:
        assert_modules_equal(m, eager)


def _spectral_lstm() -> nn.Module:
    return nn.LSTM(4, 4, num_layers=2)


@pytest.mark.parametrize("order", ["whole", "reverse", "random"])
def test_a_parametrized_recurrent_weight_is_not_read_by_materialize(order: str) -> None:
    """Found by a sweep of torch's utilities: materialize rebuilt an RNN's flat weights by
    reading each weight, which ran ``spectral_norm``'s power iteration on its ``_u``/``_v``
    (eager runs none there): other buffers, other forward, silently; and the list held the
    parametrized tensor where eager's holds the parameter."""
    def post(m: nn.Module) -> None:
        P.spectral_norm(m, "weight_hh_l0")
        P.weight_norm(m, "weight_ih_l1")

    def forward(m: nn.Module) -> Any:
        return m(_x(3, 2, 4))[0].sum()

    assert_same_as_eager(_spectral_lstm, post=post, forward=forward, orders=(order,))
    torch.manual_seed(0)
    m = fxinit.trace_init(_spectral_lstm)
    post(m)
    materialize_in_order(m, order)
    assert m._flat_weights[1] is m.parametrizations.weight_hh_l0.original


@pytest.mark.parametrize("first", ["b.weight_mask", "a.weight", "b.weight_orig"])
def test_a_pruned_weight_and_the_tensors_its_grad_fn_holds_go_together(first: str) -> None:
    """Found by a sweep of torch's utilities: after ``global_unstructured``, materializing one
    module's mask took every pruned ``weight`` of the model along, before the parameters they
    were computed from, so they kept eager's values as leaves, not eager's ``grad_fn`` (a
    warning; a backward through them gave the parameters no gradient). The tensors a computed
    tensor's ``grad_fn`` holds (parameters, the mask it saved) now come along with it."""
    def build() -> nn.Module:
        return nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})

    def post(m: nn.Module) -> None:
        prune.global_unstructured([(m["a"], "weight"), (m["b"], "weight")],
                                  pruning_method=prune.L1Unstructured, amount=0.4)

    torch.manual_seed(0)
    ref = build()
    post(ref)
    torch.manual_seed(0)
    m = fxinit.trace_init(build)
    post(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod, name = first.split(".")
        fxinit.materialize(getattr(m[mod], name))
        fxinit.materialize(m)
    assert_modules_equal(m, ref)
    for got, want in ((m["a"], ref["a"]), (m["b"], ref["b"])):
        assert type(got.weight.grad_fn) is type(want.weight.grad_fn) and not got.weight.is_leaf
        got.weight.sum().backward()
        want.weight.sum().backward()
        assert_bits(got.weight_orig.grad, want.weight_orig.grad)


@pytest.mark.parametrize("copy_with", ["deepcopy", "AveragedModel", "another RNN"])
def test_a_copy_of_a_traced_recurrent_layer_materializes_tensor_by_tensor(copy_with: str) -> None:
    """Found by a sweep of torch's utilities: the weak references a deep copy of an RNN keeps
    to its weights were looked for only in the traced model, so ``swap_tensors`` refused the
    copy's first tensor (``AveragedModel`` deep-copies the model it averages). An RNN outside
    the model given its weights holds such references too."""
    def build() -> nn.Module:
        return nn.LSTM(4, 4)

    def copied(m: nn.Module) -> nn.Module:
        if copy_with == "another RNN":
            other = nn.LSTM(4, 4)
            for name, p in m.named_parameters():
                setattr(other, name, p)
            return other
        return copy.deepcopy(m) if copy_with == "deepcopy" else torch.optim.swa_utils.AveragedModel(m).module

    torch.manual_seed(0)
    ref = copied(build())
    torch.manual_seed(0)
    m = copied(fxinit.trace_init(build))
    for t in reversed(list(m.parameters())):
        fxinit.materialize(t)
    assert_modules_equal(m, ref)
    assert [r() is w for r, w in zip(m._flat_weight_refs, m._flat_weights)] == [
        r() is w for r, w in zip(ref._flat_weight_refs, ref._flat_weights)]  # (given weights: dead in eager)
    x = _x(3, 2, 4)
    assert_bits(m(x)[0], ref(x)[0])


@pytest.mark.parametrize("order", ["reverse", "random", "mask first"])
def test_a_pruned_copy_materializes_in_any_order(order: str) -> None:
    """Found by a sweep of torch's utilities: ``prepare_qat`` deep-copies the traced model (the
    original is dropped); pruning the copy, then materializing its mask first, was refused
    (torch's swap error): what goes with a tensor was looked for in the traced model only,
    which no longer existed. Deep copies are walked too (``Recorder.copies``)."""
    import torch.ao.quantization as Q

    def build() -> nn.Module:
        m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
        m.train()
        m.qconfig = Q.get_default_qat_qconfig("x86")
        return m

    def post(m: nn.Module) -> nn.Module:
        m = Q.prepare_qat(m)
        prune.random_unstructured(m[0], "weight", amount=0.3)
        prune.l1_unstructured(m[2], "weight", amount=0.5)
        return m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the observers' deprecation warning)
        torch.manual_seed(0)
        ref = post(build())
        torch.manual_seed(0)
        m = post(fxinit.trace_init(build))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fxinit")
        if order == "mask first":
            fxinit.materialize(m[2].weight_mask)
            fxinit.materialize(m[0].weight_mask)
        materialize_in_order(m, "random" if order == "random" else "reverse")
    assert_modules_equal(m, ref)
    for i in (0, 2):
        assert type(m[i].weight.grad_fn) is type(ref[i].weight.grad_fn)


def test_a_parameter_written_with_autograd_after_the_trace_stays_a_parameter() -> None:
    """Found by the fuzzer (seed 65, small thresholds): a frozen parameter written in place from a
    tensor that requires grad (``self.w1.add_(self.m0.bias)``) gets a ``grad_fn`` and stays that
    Parameter object in eager; fxinit rebuilt its graph but gave back a plain tensor."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m0 = nn.Linear(1, 1)
            self.w1 = nn.Parameter(self.m0.bias.clone(), requires_grad=False)

    def step(m: nn.Module) -> None:
        m.w1.add_(m.m0.bias, alpha=0.5)

    eager, m = built_both(M, step)
    assert type(m.w1) is type(eager.w1) is nn.Parameter
    assert type(m.w1.grad_fn) is type(eager.w1.grad_fn) and torch.equal(m.w1, eager.w1)
