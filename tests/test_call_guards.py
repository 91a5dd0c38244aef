"""Call guards: calling a module whose tensors are deferred is refused by name; materializing
takes the guard off, part by part, through deep copies, lazy and parametrized modules and
torchdistX's calls; pickling a deferred model is refused by name."""

from __future__ import annotations

import copy
import io

import pytest

import torch
import torch.nn as nn

import fxinit
from conftest import assert_modules_equal



def test_modules_without_tensors_of_a_traced_model_pickle_as_eagers() -> None:
    """fxinit's call guard (a closure) sat on every module, so pickling a tensor-free one
    failed (found by an e3nn sweep: its modules deep-copy their generated code through pickle)."""
    import pickle

    class Holder(nn.Module):  # deep-copies a child through pickle, as e3nn's CodeGenMixin
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.act = nn.ReLU()

        def __getstate__(self) -> dict:
            state = {**self.__dict__, "_modules": dict(self._modules)}
            state["act"] = pickle.dumps(state["_modules"].pop("act"))
            return state

        def __setstate__(self, state: dict) -> None:
            act = pickle.loads(state.pop("act"))
            self.__dict__.update(state)
            self._modules["act"] = act

    torch.manual_seed(0)
    eager = copy.deepcopy(Holder())
    torch.manual_seed(0)
    m = copy.deepcopy(fxinit.trace_init(Holder))
    assert type(pickle.loads(pickle.dumps(m.act))) is nn.ReLU
    assert_modules_equal(fxinit.materialize(m), eager)
    with pytest.raises(fxinit.DeferredInitError, match="was called while its tensors are deferred"):
        fxinit.trace_init(Holder).fc(torch.ones(2))  # a module with tensors is still guarded


@pytest.mark.parametrize("order", ["tensors", "modules"])
def test_a_model_materialized_part_by_part_keeps_no_call_guard(order: str) -> None:
    """Found by a sweep of model-inspection tools: after materializing tensor by tensor (or
    module by module) the guards stayed on every module they were not asked of (the root),
    so the model did not pickle, ``torch.save`` or script, where eager's does."""
    import pickle

    m = fxinit.trace_init(lambda: nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 1))))
    parts = list(m.parameters()) if order == "tensors" else [m[2][0], m[0]]
    for part in reversed(parts):
        fxinit.materialize(part)
    assert not fxinit.is_deferred(m)
    assert all(not mod._forward_pre_hooks for mod in m.modules())
    pickle.loads(pickle.dumps(m))
    torch.jit.script(m)


def _no_call_guards(m: nn.Module) -> bool:
    return all(not mod._forward_pre_hooks for mod in m.modules())


@pytest.mark.parametrize("order", ["whole", "tensors", "modules"])
def test_a_deep_copy_of_a_deferred_model_is_guarded_and_unguarded_on_its_own(order: str) -> None:
    """Found by a sweep of Ultralytics (``ModelEMA`` deep-copies the model; its checkpoint is
    ``torch.save``d): the copy kept the guards of the modules it was copied from, never taken
    off, so the materialized copy did not pickle, save or script; and calling it took the
    original's guards off."""
    import pickle

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)))

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    m = fxinit.trace_init(build)
    c = copy.deepcopy(m)
    with pytest.raises(fxinit.DeferredInitError, match="was called while its tensors are deferred"):
        c(torch.ones(1, 2))
    parts = {"whole": [c], "tensors": list(reversed(list(c.parameters()))), "modules": [c[1][1], c[1][0], c[0]]}
    for part in parts[order]:
        fxinit.materialize(part)
    assert_modules_equal(c, eager)
    assert _no_call_guards(c)
    pickle.loads(pickle.dumps(c))
    torch.jit.script(c)
    c(torch.ones(1, 2))
    with pytest.raises(fxinit.DeferredInitError, match="was called while its tensors are deferred"):
        m(torch.ones(1, 2))  # the original is guarded still
    fxinit.materialize(m[1])
    fxinit.materialize(m[0].weight)
    fxinit.materialize(m[0].bias)
    assert _no_call_guards(m)


def test_a_tensor_given_to_a_module_after_the_trace_takes_its_guard_off() -> None:
    """Conv + batch-norm fusion after the trace (Ultralytics' ``fuse()``) gives the conv new
    parameters; materialized tensor by tensor, the guards stayed on (found by the same sweep)."""
    def fuse(m: nn.Sequential) -> None:
        conv, bn = m[0], m[1]
        conv.weight, conv.bias = torch.nn.utils.fusion.fuse_conv_bn_weights(
            conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias)
        m[1] = nn.Identity()

    m = fxinit.trace_init(lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    fuse(m)
    fxinit.materialize(m[0].bias)
    fxinit.materialize(m[0].weight)
    assert _no_call_guards(m)
    torch.save(m, io.BytesIO())


_TABLE = torch.arange(4.0)


class _FromATable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", _TABLE.to(dtype=torch.float64, copy=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :2]


def test_a_module_whose_tensors_are_real_has_no_guard_and_pickling_a_deferred_one_is_refused_by_name() -> None:
    """A module of a traced model whose tensors the trace made real (computed from a tensor that
    existed before it: e3nn's cached coefficients) pickles before ``materialize``, as eager's
    (found by a sweep of e3nn and MACE: ``copy.deepcopy`` of their modules pickles a part of them).
    A module with deferred tensors refuses to pickle by name, and to be scripted."""
    import pickle

    m = fxinit.trace_init(lambda: nn.Sequential(_FromATable(), nn.Linear(2, 2)))
    assert not fxinit.is_deferred(m[0]) and _no_call_guards(m[0])
    pickle.loads(pickle.dumps(m[0]))
    with pytest.raises(fxinit.DeferredInitError, match="holds deferred tensors, which cannot be pickled"):
        pickle.dumps(m)
    with pytest.raises(fxinit.DeferredInitError, match="TorchScript cannot compile it"):
        torch.jit.script(m)
    fxinit.materialize(m)
    assert _no_call_guards(m)
    torch.jit.script(m)


def test_guards_follow_lazy_modules_ties_and_unregistered_copies() -> None:
    """Found by the review of the guards: a lazy module's uninitialized parameters were not
    waited for (after ``dry_run`` the deferred model could be called); a tie made after the trace
    (no node recorded) left the root's guard on, materialized tensor by tensor, and pickling then
    said falsely that tensors were deferred; a copy made by a ``__deepcopy__`` that does not tell
    ``copy.deepcopy`` of itself shared the original's guard, and calling it took the original's off."""
    import pickle

    lazy = fxinit.trace_init(lambda: nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.Linear(3, 2)))
    fxinit.dry_run(lazy, torch.ones(1, 4))
    with pytest.raises(fxinit.DeferredInitError, match="was called while its tensors are deferred"):
        lazy(torch.ones(1, 4))
    for t in reversed(list(lazy.parameters())):
        fxinit.materialize(t)
    assert _no_call_guards(lazy)

    tied = fxinit.trace_init(lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    tied[0].weight = tied[1].weight
    for t in (tied[0].bias, tied[1].weight, tied[1].bias):
        fxinit.materialize(t)
    assert _no_call_guards(tied)
    pickle.dumps(tied)

    class OwnCopy(nn.Linear):
        def __deepcopy__(self, memo: dict) -> "OwnCopy":
            new = OwnCopy.__new__(OwnCopy)
            new.__dict__ = copy.deepcopy(self.__dict__, memo)
            return new

    m = fxinit.trace_init(lambda: nn.Sequential(OwnCopy(2, 2)))
    c = copy.deepcopy(m)
    fxinit.materialize(c)
    c(torch.ones(1, 2))
    assert _no_call_guards(c)
    with pytest.raises(fxinit.DeferredInitError, match="was called while its tensors are deferred"):
        m[0](torch.ones(1, 2))


def test_a_parametrized_module_is_guarded_and_unguarded() -> None:
    """Found by the second review: a model whose only tensors sat in a parametrized module had
    no guard at all (parametrizations compute weights, unguarded; their owner now is guarded)."""
    from torch.nn.utils.parametrizations import weight_norm

    m = fxinit.trace_init(lambda: nn.Sequential(weight_norm(nn.Linear(4, 4))))
    with pytest.raises(fxinit.DeferredInitError, match="was called while its tensors are deferred"):
        m(torch.ones(1, 4))
    for t in reversed(list(m.parameters())):
        fxinit.materialize(t)
    assert _no_call_guards(m)
    m(torch.ones(1, 4))


def test_torchdistx_materialize_module_takes_the_guards_off() -> None:
    m = fxinit.trace_init(lambda: nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))))
    fxinit.materialize_module(m)
    assert _no_call_guards(m)
