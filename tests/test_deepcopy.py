"""``copy.deepcopy`` of deferred tensors, in a constructor (``_get_clones``) and after the trace
(an EMA teacher): what eager's ``Tensor.__deepcopy__`` and ``Parameter.__deepcopy__`` make.
A plain tensor's storage is copied once, whole, and each tensor on it keeps its layout (offset,
strides, the memory expanded elements share); a parameter is cloned, without the attributes
and hooks set on it; a plain tensor's attributes are deep-copied, and its gradient too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxinit
from tests.conftest import compare_modules


class Views(nn.Module):
    """speechbrain's ``Filterbank``: ``self.f_central = hz[1:-1]``; views of every kind; a
    buffer over a parameter's storage; a buffer and a view of it."""

    def __init__(self) -> None:
        super().__init__()
        hz = torch.linspace(0.0, 8000.0, 10)
        self.f_central = hz[1:-1]
        self.register_buffer("tail", torch.randn(10)[2:])
        self.register_buffer("every_other", torch.randn(10)[::2])
        self.register_buffer("expanded", torch.randn(1, 4).expand(3, 4))
        self.register_buffer("cache", torch.randn(2, 3))
        self.register_buffer("cos", self.cache[0])
        self.w = nn.Parameter(torch.randn(4, 3))
        self.register_buffer("wt", self.w.detach()[1:].t())
        self.lin = nn.Linear(3, 2)


class Clones(nn.Module):
    """The ``_get_clones`` idiom: copies of a prototype layer, made in the constructor."""

    def __init__(self) -> None:
        super().__init__()
        proto = Views()
        self.layers = nn.ModuleList(copy.deepcopy(proto) for _ in range(2))


def _layouts(m: nn.Module) -> dict[str, tuple]:
    tensors = dict(m.state_dict(keep_vars=True))
    tensors.update({f"{k}.f_central": v.f_central for k, v in m.named_modules() if hasattr(v, "f_central")})
    return {k: (t.stride(), t.storage_offset(), t.untyped_storage().nbytes()) for k, t in tensors.items()}


@pytest.mark.parametrize("where", ["constructor", "after the trace"])
def test_deep_copies_keep_eagers_layouts_and_sharing(where: str) -> None:
    """Found by a speechbrain sweep: a view's copy was a compact clone (``hz[1:-1]`` at offset
    0), and tensors sharing one storage were refused."""
    ctor = Clones if where == "constructor" else Views
    torch.manual_seed(0)
    eager = ctor() if where == "constructor" else copy.deepcopy(ctor())
    torch.manual_seed(0)
    traced = fxinit.trace_init(ctor)
    if where != "constructor":
        traced = copy.deepcopy(traced)
    fxinit.materialize(traced)
    assert compare_modules(traced, eager, "") == []  # values, strides, which names share memory
    assert _layouts(traced) == _layouts(eager)
    if where == "constructor":
        assert fxinit.check(Clones).ok


class Dressed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.w.flag = "on the parameter"
        self.w.register_hook(lambda g: g * 0)
        self.register_buffer("b", torch.randn(3))
        self.b.table = {"k": [1]}
        self.b.grad = torch.ones(3)


def test_deep_copies_take_attributes_hooks_and_gradients_as_eager() -> None:
    """Eager's ``Parameter.__deepcopy__`` is ``type(p)(p.data.clone(), p.requires_grad)``: no
    attributes, no hooks, no gradient; a plain tensor's ``__dict__`` and gradient are deep-copied.
    fxinit had carried the parameter's attributes and hooks over, and shared the dict."""
    seen = []
    for traced in (False, True):
        torch.manual_seed(0)
        m = fxinit.trace_init(Dressed) if traced else Dressed()
        c = copy.deepcopy(m)
        if traced:
            fxinit.materialize(c)
        c.w.sum().backward()
        seen.append((getattr(c.w, "flag", None), c.b.table, c.b.table is m.b.table, c.w.grad.tolist(),
                     c.b.grad.tolist()))
    assert seen[0] == seen[1]


class OtherDtypes(nn.Module):
    """Tensors of several dtypes on one storage, and views torch resolves on a copy (conj, neg)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.randn(4))
        self.register_buffer("b", self.a.view(torch.int32)[1:])
        c = torch.randn(3, dtype=torch.complex64)
        self.register_buffer("re", torch.view_as_real(c)[1:])
        self.register_buffer("c", c)
        self.register_buffer("neg_imag", c.conj().imag)
        self.register_buffer("conj", torch.randn(2, dtype=torch.complex64).conj())


def test_deep_copies_of_storages_viewed_as_other_dtypes() -> None:
    """A storage is copied as bytes: each tensor on it keeps its own dtype (a review found the
    first tensor's dtype given to all, and a conjugate's imaginary part with its sign flipped)."""
    torch.manual_seed(0)
    eager = copy.deepcopy(OtherDtypes())
    torch.manual_seed(0)
    traced = copy.deepcopy(fxinit.trace_init(OtherDtypes))
    fxinit.materialize(traced)
    assert compare_modules(traced, eager, "") == [] and _layouts(traced) == _layouts(eager)
    assert all(a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg()
               for a, b in zip(traced.buffers(), eager.buffers()))


def test_a_storage_of_no_whole_number_of_elements_is_refused() -> None:
    class Reinterpreted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("f", torch.arange(6, dtype=torch.uint8)[:4].view(torch.float32))

    copy.deepcopy(Reinterpreted())
    with pytest.raises(fxinit.DeferredInitError, match="not a whole number of its elements"):
        copy.deepcopy(fxinit.trace_init(Reinterpreted))


class Tagged(nn.Parameter):
    """A parameter class with its own ``__deepcopy__`` (quantized parameters carry their state
    this way): eager's copy is what that method makes."""

    def __new__(cls, data: torch.Tensor, tag: str = "") -> "Tagged":
        p = super().__new__(cls, data)
        p.tag = tag
        return p

    def __deepcopy__(self, memo: dict) -> "Tagged":
        new = type(self)(self.data.clone(), tag=self.tag + " copy")
        memo[id(self)] = new
        return new


def test_a_parameter_class_with_its_own_deep_copy_is_refused_by_name() -> None:
    def copied_in_the_constructor() -> nn.Module:
        m = nn.Module()
        m.w = Tagged(torch.randn(3), tag="w")
        m.v = copy.deepcopy(m.w)
        return m

    assert copied_in_the_constructor().v.tag == "w copy"
    with pytest.raises(fxinit.DeferredInitError, match="Tagged: the class defines its own __deepcopy__") as info:
        fxinit.trace_init(copied_in_the_constructor)
    assert "m.v = copy.deepcopy(m.w)" in str(info.value)  # the caller's line, not copy.py's
