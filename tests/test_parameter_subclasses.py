"""``nn.Parameter`` subclasses with code of their own, during the trace and after it (found by a
bitsandbytes sweep: ``Params4bit.to`` and ``Int8Params.to`` quantize on a move, and set tensor
attributes on the parameter; ``Params4bit.__torch_function__`` keeps the class of
``torch.chunk``'s pieces; layer swaps build ``Params4bit(old.weight.data)``; nanotron wraps
``NanotronParameter(p)``). A deferred tensor's type is fxinit's, so Python skipped that code:
the moves gave float32 parameters where eager's are int8, silently; layer swaps and deep copies
of models holding a subclass crashed after the trace; tensors set on a parameter stayed
deferred after materialize."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

import fxinit
from conftest import assert_same_as_eager, compare_modules


class Quantized(nn.Parameter):
    """Quantizes itself on a move to a device, as bitsandbytes' ``Int8Params.to``; keeps its
    class through ``torch.chunk``, as ``Params4bit.__torch_function__``."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = False) -> "Quantized":
        return torch.Tensor._make_subclass(cls, data, requires_grad)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and self.dtype != torch.int8:
            return self._quantize()
        return Quantized(super().to(*args, **kwargs), self.requires_grad)

    def _quantize(self) -> "Quantized":
        scale = self.data.abs().amax(dim=1, keepdim=True) / 127
        self.data = (self.data / scale).round().to(torch.int8)
        self.scale = scale  # a tensor the parameter holds
        return self

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs or {})
        return tuple(Quantized(c) for c in out) if func is torch.chunk else out


class QuantizedLinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 6)
        self.weight = Quantized(self.weight.data)


def test_a_subclass_method_runs_on_a_move_in_the_constructor_and_after_the_trace() -> None:
    assert_same_as_eager(lambda: QuantizedLinear().to("cpu"), seeds=(0,))
    assert_same_as_eager(QuantizedLinear, seeds=(0,), post=lambda m: m.to("cpu"))
    torch.manual_seed(0)
    m = fxinit.trace_init(QuantizedLinear).to("cpu")
    fxinit.materialize(m)
    assert m.weight.dtype == torch.int8 and not fxinit.is_deferred(m.weight.scale)


def test_a_subclass_torch_function_keeps_its_pieces_class() -> None:
    pieces = {}

    def chunked(m: nn.Module) -> None:  # positionally, by keyword (found by a review), and in a list
        pieces[fxinit.is_deferred(m.weight)] = (*torch.chunk(m.weight, 2), *torch.chunk(input=m.weight, chunks=2),
                                                 torch.cat([m.weight, m.weight]))

    assert_same_as_eager(QuantizedLinear, seeds=(0,), orders=("whole",), post=chunked)
    assert [isinstance(p, Quantized) for p in pieces[True]] == [isinstance(p, Quantized) for p in pieces[False]] \
        == [True] * 4 + [False]
    assert pieces[True][0].__class__ is Quantized


class Tracked(nn.Parameter):
    """nanotron's ``NanotronParameter``: a wrapper built from a parameter, with metadata."""

    def __new__(cls, tensor: torch.Tensor, requires_grad: bool = True) -> "Tracked":
        p = nn.Parameter.__new__(cls, data=tensor.data.detach(), requires_grad=requires_grad)
        p.metadata = {"sharded": False}
        return p


class Plain(nn.Parameter):
    pass


def test_parameters_rewrapped_after_the_trace_and_deep_copies_of_subclasses() -> None:
    def swapped(m: nn.Module) -> None:  # a layer swap after the trace
        m.weight = Tracked(m.weight)
        m.bias = Quantized(m.bias.data)

    assert_same_as_eager(lambda: nn.Linear(4, 3), seeds=(0,), post=swapped)

    def plain() -> nn.Module:
        m = nn.Linear(4, 4)
        m.weight = Plain(torch.randn(4, 4))
        return m

    torch.manual_seed(0)
    want = copy.deepcopy(plain())
    torch.manual_seed(0)
    got = copy.deepcopy(fxinit.trace_init(plain))
    assert isinstance(got.weight, Plain) and compare_modules(fxinit.materialize(got), want) == []


class Packed(nn.Parameter):
    """bitsandbytes' ``Params4bit``: a ``__new__`` that takes its own keywords and no others."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = False,
                blocksize: int = 64, quant_state: Any = None) -> "Packed":
        p = torch.Tensor._make_subclass(cls, data, requires_grad)
        p.blocksize, p.quant_state = blocksize, quant_state
        return p


class PackedLinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 4)
        self.weight = Packed(self.weight.data, blocksize=32)


def test_a_parameter_rebuilt_from_its_dict_after_materialize() -> None:
    """transformers' and accelerate's bitsandbytes loading rebuild a parameter from its own
    attributes: ``Params4bit(value, requires_grad=False, **old.__dict__)``. fxinit's mark of
    what it materialized was one of them, so the rebuild raised a TypeError (an unexpected
    keyword) where eager's works; the mark is kept beside the tensor now, and a materialized
    tensor's attributes are eager's (``compare_modules`` checks them everywhere)."""
    def reloaded(m: nn.Module) -> None:
        old = m.weight
        m.weight = type(old)(torch.ones_like(old.data), requires_grad=False, **old.__dict__)

    assert_same_as_eager(PackedLinear, seeds=(0,), orders=("whole", "reverse"))
    torch.manual_seed(0)
    want = PackedLinear()
    torch.manual_seed(0)
    got = fxinit.materialize(fxinit.trace_init(PackedLinear))
    assert got.weight.__dict__ == want.weight.__dict__ == {"blocksize": 32, "quant_state": None}
    reloaded(want)
    reloaded(got)
    assert compare_modules(got, want) == []
