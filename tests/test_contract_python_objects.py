"""The capture contract for the Python objects a constructor keeps and the classes its tensors
are made as (docs/capture-contract.md): the dict ``locals()`` returned, weak references to
the model's tensors, ``nn.Parameter`` subclasses' ``__init__``, tensor subclasses'
``__torch_function__``. Each test here was found by a sweep, as a silent difference.
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import fxinit
from conftest import compare_modules, materialize_in_order, same_bits


def _assert_equal(eager: nn.Module, traced: nn.Module) -> None:
    assert compare_modules(traced, eager) == []


class _KeepsItsLocals(nn.Module):
    """imagen-pytorch's and dalle2-pytorch's Unet: ``locals()`` kept, ``self`` taken out of it,
    the module rebuilt from it later (``type(self)(**self._locals)``)."""

    def __init__(self, dim: int = 4, mult: int = 2) -> None:
        super().__init__()
        self._locals = locals()
        del self._locals["self"], self._locals["__class__"]
        dim = dim * mult
        self.p = nn.Parameter(torch.randn(dim))  # an op recorded in this frame
        nn.init.normal_(self.p)


def test_the_dict_locals_returned_in_a_constructor_is_its_own() -> None:
    """Found by a sweep of lucidrains' models: to name the module of each op it recorded, the
    capture read ``frame.f_locals``, which on Python 3.10-3.12 copies the frame's variables into
    the dict ``locals()`` returned there: the deleted ``self`` came back (rebuilding from it
    raised a TypeError) and ``dim`` was 8, silently. The capture reads a frame's arguments from
    its slots now (``capture/frame_arguments``)."""
    torch.manual_seed(0)
    eager = _KeepsItsLocals()
    torch.manual_seed(0)
    traced = fxinit.trace_init(_KeepsItsLocals)
    assert traced._locals == eager._locals == {"dim": 4, "mult": 2}
    rebuilt = fxinit.trace_init(lambda: type(traced)(**traced._locals))
    assert rebuilt.p.shape == (8,)
    assert "by torch.nn.init.normal_, module <root>" in fxinit.init_graph(traced).explain("p")  # (still found)


class _HoldsWeakReferences(nn.Module):
    """A cache keyed weakly by parameter, a weak reference kept, an optimizer built in
    ``__init__``: each refers to the tensor objects the model holds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.weak = weakref.ref(self.lin.weight)
        self.groups = torch.utils.weak.WeakTensorKeyDictionary()
        self.groups[self.lin.bias] = "no_decay"
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("order", ["whole", "reverse", "random"])
def test_tensors_weak_references_point_to_are_the_ones_made_real(order: str) -> None:
    """Found by a sweep of constructor patterns: ``swap_tensors`` refuses a tensor that weak
    references point to, and fxinit put a new object in the module's place instead (warned):
    the optimizer built in ``__init__`` held the old one, deferred, and its steps did nothing.
    The value now goes into the object itself (``capture/swap.py``), which the references
    point to, as eager's do."""
    torch.manual_seed(0)
    eager = _HoldsWeakReferences()
    torch.manual_seed(0)
    traced = fxinit.trace_init(_HoldsWeakReferences)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize_in_order(traced, order)
    _assert_equal(eager, traced)
    assert traced.weak() is traced.lin.weight and dict(traced.groups) == {traced.lin.bias: "no_decay"}
    for m in (eager, traced):
        assert m.opt.param_groups[0]["params"][0] is m.lin.weight
        m.lin(torch.ones(1, 4)).sum().backward()
        m.opt.step()
    assert same_bits(traced.lin.weight.detach(), eager.lin.weight.detach())


class _FlatParameter(nn.Parameter):
    """fairscale's ``FlatParameter``: ``__new__`` builds the tensor, ``__init__`` keeps what it
    was built from."""

    def __new__(cls, params: list, requires_grad: bool = True) -> "_FlatParameter":
        return super().__new__(cls, torch.cat([p.detach().reshape(-1) for p in params]), requires_grad)

    def __init__(self, params: list, requires_grad: bool = True) -> None:
        self.numels = [p.numel() for p in params]


class _Flattened(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inner = nn.Linear(4, 4)
        self.flat = _FlatParameter([inner.weight, inner.bias])


def test_a_parameter_subclass_runs_its_init() -> None:
    """Found by a sweep of fairscale (``FlattenParamsWrapper``, its FSDP's default): Python runs
    ``MyParameter.__init__`` only on an object of that very type; a deferred tensor made as one
    is not, so ``__init__`` never ran: a class default in its place, silently, or an
    AttributeError. ``check`` compared tensors only and said equal."""
    torch.manual_seed(0)
    eager = _Flattened()
    torch.manual_seed(0)
    traced = fxinit.trace_init(_Flattened)
    assert traced.flat.numels == [16, 4]
    fxinit.materialize(traced)
    _assert_equal(eager, traced)
    assert type(traced.flat) is _FlatParameter and traced.flat.numels == eager.flat.numels


class _Base(nn.Parameter):
    def __new__(cls, data: torch.Tensor) -> "_Base":
        return super().__new__(_Made if cls is _Base else cls, data)

    def __init__(self, data: torch.Tensor) -> None:
        self.by = "_Base"


class _Made(_Base):
    def __init__(self, data: torch.Tensor) -> None:
        self.by = "_Made"


def test_the_init_that_runs_is_that_of_the_class_made() -> None:
    """Found by a review: ``__new__`` returning an object of a subclass gets that subclass's
    ``__init__`` in eager (Python runs the object's own type's); fxinit ran the called class's."""
    eager = _Base(torch.zeros(2))
    traced = fxinit.trace_init(lambda: nn.ParameterList([_Base(torch.zeros(2))]))[0]
    assert type(eager) is _Made and eager.by == "_Made" and traced.by == "_Made"


class _Clamped(torch.Tensor):
    """A tensor subclass whose ``__torch_function__`` changes every result, and logs the calls."""

    calls: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        cls.calls.append(getattr(func, "__name__", str(func)))
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, torch.Tensor) and out.is_floating_point() and func is not torch.Tensor.clamp:
            out = out.clamp(-1.0, 1.0)
        return out


class _Tagged(torch.Tensor):
    pass


class _OfSubclasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        t = torch.randn(6).as_subclass(_Clamped)
        self.register_buffer("clamped", t.mul(3.0).add(0.5))
        tagged = torch.randn(4).as_subclass(_Tagged)
        self.register_buffer("tagged", tagged * 2)
        self.register_buffer("copied", torch.cat([tagged, tagged.clone()]))


def test_ops_on_a_tensor_subclass_run_its_torch_function() -> None:
    """Found by a sweep of constructor patterns: ops on a deferred tensor made by
    ``as_subclass`` ran as a plain tensor's: results of the plain class, and a
    ``__torch_function__`` that changes them was skipped, silently. It takes every call now,
    methods included, as in eager; torch's own gives results of the subclass."""
    _Clamped.calls.clear()
    torch.manual_seed(0)
    eager = _OfSubclasses()
    eager_calls = list(_Clamped.calls)
    _Clamped.calls.clear()
    torch.manual_seed(0)
    traced = fxinit.materialize(fxinit.trace_init(_OfSubclasses))
    assert _Clamped.calls == eager_calls
    _assert_equal(eager, traced)
    assert {type(b) for b in traced.buffers()} == {_Clamped, _Tagged}


class _Declines(torch.Tensor):
    """``__torch_function__`` as torch's docs write it: ``NotImplemented`` for types it does not know."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not all(issubclass(t, cls) for t in types):
            return NotImplemented
        return super().__torch_function__(func, types, args, kwargs or {})


class _Accepts(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        return super().__torch_function__(func, (cls,), args, kwargs or {})  # (whatever the other types)


class _TwoSubclasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        a = torch.randn(3).as_subclass(_Declines)
        b = torch.randn(3).as_subclass(_Accepts)
        self.register_buffer("sum", torch.add(a, b))
        self.register_buffer("again", a.as_subclass(_Declines).as_subclass(_Accepts))


def test_the_torch_function_protocol_over_two_subclasses_is_eagers() -> None:
    """Found by a review: with two subclasses in one call, each handler is asked in turn with
    both types, the next one where a handler returns ``NotImplemented`` (the result was the
    first class's, silently); ``as_subclass`` of a deferred tensor showed its own alias op to
    the handler, which eager's never does."""
    torch.manual_seed(0)
    eager = _TwoSubclasses()
    torch.manual_seed(0)
    traced = fxinit.materialize(fxinit.trace_init(_TwoSubclasses))
    _assert_equal(eager, traced)
    assert type(traced.sum) is type(eager.sum) is _Accepts and type(traced.again) is _Accepts


class _CombinesAGivenSubclass(nn.Module):
    def __init__(self, given: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6) * 3)
        self.register_buffer("product", torch.mul(self.w, given))
        self.register_buffer("total", self.w.add(given))


def test_a_real_tensor_subclass_handed_in_runs_its_torch_function() -> None:
    """A real tensor of a subclass whose ``__torch_function__`` changes results, handed to the
    constructor and combined with a deferred tensor, the deferred one first: DeferredTensor's
    own handler took the call and the subclass's code was skipped (other values and class,
    silently). The other handlers run first now, in torch's order, as eager's protocol runs
    them without DeferredTensor among the types."""
    given = (torch.ones(6) * 2).as_subclass(_Clamped)
    torch.manual_seed(0)
    eager = _CombinesAGivenSubclass(given)
    torch.manual_seed(0)
    traced = fxinit.materialize(fxinit.trace_init(_CombinesAGivenSubclass, given))
    _assert_equal(eager, traced)
    assert type(traced.product) is _Clamped and traced.total.abs().max() == 1


class _Bare(torch.Tensor):
    """A subclass with torch's own ``__torch_function__``: results of its class."""


def test_a_real_tensor_of_a_bare_subclass_handed_in_keeps_its_class() -> None:
    """Found by a fuzzer: ``self.w * given.as_subclass(Sub)`` with ``Sub`` defining no
    ``__torch_function__`` of its own gave a plain tensor where eager's is a ``Sub`` (torch's
    handler converts results to the class), in either order, with or without grad."""
    given = (torch.ones(6) * 2).as_subclass(_Bare)
    torch.manual_seed(0)
    eager = _CombinesAGivenSubclass(given)
    torch.manual_seed(0)
    traced = fxinit.materialize(fxinit.trace_init(_CombinesAGivenSubclass, given))
    _assert_equal(eager, traced)
    assert type(traced.product) is type(traced.total) is type(eager.product) is _Bare
