"""The capture contract's doors where memory is shared (docs/capture-contract.md): ``.data =``
between real and deferred tensors, numpy round trips after the trace, and tensors computed
with autograd from parameters — eager's values, eager's sharing, eager's gradients."""

from __future__ import annotations

import warnings

from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxinit
from fxinit.errors import DeferredInitError
from conftest import same_bits


def _both(build: Callable[[], nn.Module], post: Callable[[nn.Module], Any] | None = None
          ) -> tuple[nn.Module, nn.Module]:
    models = []
    for traced in (False, True):
        torch.manual_seed(0)
        m = fxinit.trace_init(build) if traced else build()
        if post is not None:
            post(m)
        if traced:
            fxinit.materialize(m)
        models.append(m)
    return models[0], models[1]


def _both_unwarned(build: Callable[[], nn.Module], dtype: torch.dtype | None = None) -> tuple[nn.Module, nn.Module]:
    """Eager construction (then ``Module.to(dtype)``), and ``materialize(dtype=dtype)`` of its trace,
    where a warning is an error."""
    torch.manual_seed(0)
    eager = build() if dtype is None else build().to(dtype)
    torch.manual_seed(0)
    traced = fxinit.trace_init(build)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxinit.materialize(traced, dtype=dtype)
    return eager, traced


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_vector_to_parameters_after_the_trace_gives_views_of_one_vector() -> None:
    vec = torch.arange(6.0)
    m = fxinit.trace_init(nn.Linear, 2, 2)
    nn.utils.vector_to_parameters(vec, m.parameters())
    assert not fxinit.is_deferred(m) and _shares(m.weight, vec) and _shares(m.bias, vec)
    vec.mul_(2)  # eager's parameters see it
    assert m.bias.tolist() == [8.0, 10.0] and isinstance(m.weight, nn.Parameter)


def test_real_data_set_to_a_deferred_tensor_becomes_deferred_and_shares_its_storage() -> None:
    held = torch.zeros(3)

    def post(m: nn.Module) -> None:
        held.data = m.weight.detach()[0]
        with torch.no_grad():
            m.weight.mul_(2)  # eager's `held` sees this write

    torch.manual_seed(0)
    eager = nn.Linear(3, 2)
    post(eager)
    want = held.clone()
    torch.manual_seed(0)
    traced = fxinit.trace_init(nn.Linear, 3, 2)
    post(traced)
    assert fxinit.is_deferred(held)
    fxinit.materialize(traced)  # the caller's `held` too, as it shares the model's storage
    assert not fxinit.is_deferred(held) and same_bits(held, want) and _shares(held, traced.weight)


def test_numpy_after_the_trace_is_the_tensors_memory() -> None:
    def post(m: nn.Module) -> None:
        m.t = torch.as_tensor(m.b.numpy())  # eager: the buffer's memory
        m.b.add_(1)
        m.b.numpy()[0] = 7.0

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.zeros(3))

    eager, traced = _both(M, post)
    assert same_bits(traced.b, eager.b) and same_bits(traced.t, eager.t) and _shares(traced.t, traced.b)


class ViewBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("v", torch.randn(2, 3).view(3, 2))  # a view: numpy() after the trace copies it


def test_a_write_after_numpy_of_a_view_is_refused_only_while_the_array_lives() -> None:
    def copy_then_write(m: nn.Module) -> None:
        m.c = torch.tensor(m.v.numpy())  # a copy: the array dies here (found by the capture fuzzer)
        m.v.mul_(2)

    eager, traced = _both(ViewBuffer, copy_then_write)
    assert same_bits(traced.v, eager.v) and same_bits(traced.c, eager.c)

    torch.manual_seed(0)
    traced = fxinit.trace_init(ViewBuffer)
    traced.a = torch.as_tensor(traced.v.numpy())  # eager's shares the buffer's memory: it would see the write
    with pytest.raises(DeferredInitError, match="through numpy"):
        traced.v.mul_(2)


def test_from_numpy_of_an_alias_after_the_trace_aliases_the_tensor() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w0 = nn.Parameter(torch.randn(3))

    def post(m: nn.Module) -> None:
        m.w1 = nn.Parameter(torch.from_numpy(m.w0.detach().numpy()))

    eager, traced = _both(M, post)
    assert same_bits(traced.w1, eager.w1) and _shares(traced.w1, traced.w0)
    assert isinstance(np.asarray(traced.w0.detach()), np.ndarray)


class FromNumpyOfAView(nn.Module):
    """A tensor made from the array of a view whose size-one dimension has a stride of 2
    (``w0.t().contiguous()`` is ``w0.t()``): eager's array keeps that stride, and so does a
    tensor made from it (found by tools/fuzz_capture.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.w0 = nn.Parameter(torch.zeros((1, 2)))
        self.w3 = nn.Parameter(self.w0.t().contiguous())
        self.w5 = nn.Parameter(torch.tensor(self.w3.detach().numpy()))
        self.w6 = nn.Parameter(torch.tensor(np.asarray(self.w0.detach().expand(3, 2))))


def test_arrays_of_deferred_tensors_have_eagers_strides() -> None:
    eager = FromNumpyOfAView()
    got = fxinit.materialize(fxinit.trace_init(FromNumpyOfAView))
    for name in ("w3", "w5", "w6"):
        assert getattr(got, name).stride() == getattr(eager, name).stride(), name
        assert same_bits(getattr(got, name), getattr(eager, name)), name


def test_a_kept_tensor_at_the_end_of_a_long_chain_of_ops() -> None:
    """A ``grad_fn`` graph deeper than Python's recursion limit (6,000 ops on one tensor in
    ``__init__``): reading its shape recursed once per op and raised ``RecursionError`` where
    eager builds. The tensor keeps eager's values, a leaf past the replay's recipe size, said aloud."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(2))
            g = self.w * 2
            for _ in range(6000):
                g = g + 1
            self.register_buffer("g", g)

    torch.manual_seed(0)
    eager = M()
    torch.manual_seed(0)
    m = fxinit.trace_init(M)
    with pytest.warns(UserWarning, match=r"not eager's grad_fn \(AddBackward0"):
        fxinit.materialize(m)
    assert same_bits(m.g, eager.g) and same_bits(m.w, eager.w)


def test_a_kept_view_of_a_temporary_keeps_its_grad_fn() -> None:
    """``(w * 2).t()`` kept as a buffer: the replay rebuilt it, and a check that counted every
    reference to its memory (fxinit's own included) took the temporary's memory for shared
    with another tensor, so the buffer lost ``TBackward0``, with a warning."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4))
            self.register_buffer("o", (self.w * 2).t())

    eager, traced = _both(M)
    assert type(traced.o.grad_fn).__name__ == type(eager.o.grad_fn).__name__ == "TBackward0"
    assert traced.o.stride() == eager.o.stride() and same_bits(traced.o, eager.o)
    (got,), (want,) = torch.autograd.grad(traced.o.sum(), [traced.w]), torch.autograd.grad(eager.o.sum(), [eager.w])
    assert same_bits(got, want)


class BatchNormOfRealStatistics(nn.Module):
    def __init__(self, mean: torch.Tensor, var: torch.Tensor, training: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        with torch.no_grad():
            self.normed = F.batch_norm(self.w, mean, var, training=training, momentum=0.5)


def test_an_op_that_writes_a_real_tensor_given_with_deferred_ones_is_refused() -> None:
    """``F.batch_norm`` in training updates the running statistics it is given in place, which
    its name does not say: real ones were lifted as copies, the write went to the copy, and the
    caller's tensors silently kept their values. In evaluation nothing is written: eager's."""
    with pytest.raises(DeferredInitError, match="wrote into a real tensor it was given with deferred ones"):
        fxinit.trace_init(BatchNormOfRealStatistics, torch.zeros(3), torch.ones(3), True)
    lin = fxinit.trace_init(nn.Linear, 3, 4)
    mean, var = torch.zeros(3), torch.ones(3)
    with pytest.raises(DeferredInitError, match="wrote into a real tensor"), torch.no_grad():
        F.batch_norm(lin.weight, mean, var, training=True)  # an init step after the trace
    assert torch.equal(mean, torch.zeros(3))
    results = []
    for trace in (False, True):
        torch.manual_seed(0)
        args = (mean, var, False)
        m = fxinit.materialize(fxinit.trace_init(BatchNormOfRealStatistics, *args)) if trace \
            else BatchNormOfRealStatistics(*args)
        results.append(m.normed)
    assert torch.equal(*results) and torch.equal(mean, torch.zeros(3)) and torch.equal(var, torch.ones(3))
