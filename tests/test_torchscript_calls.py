"""TorchScript called on deferred tensors (found by a sweep of fairchem's models: e3nn's
``spherical_harmonics_alpha``, scripted, builds ``torch.arange(..., device=alpha.device)``).
TorchScript saw the meta tensor underneath a deferred one: a branch on ``a.device`` took the
meta branch (other values, silently), a factory on it left a meta tensor after materialize
(silently), and e3nn's product failed at materialize with torch's device error. Running the
Python functions instead (the first fix) was not TorchScript either, as two reviews showed:
argument conversions, ``round``, ``is_scripting()`` in a callee. TorchScript itself runs now,
traced on fake CPU tensors, and its ops are recorded."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.nn as nn

import fxinit
from conftest import assert_same_as_eager


@torch.jit.script
def _by_device(a: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cpu":
        return a * 2
    return a * 3


@torch.jit.script
def _ones_beside(a: torch.Tensor) -> torch.Tensor:
    return torch.ones(3, dtype=a.dtype, device=a.device) + a.sum()


@torch.jit.script
def _harmonics(l: int, alpha: torch.Tensor) -> torch.Tensor:  # e3nn's spherical_harmonics_alpha, shortened
    m = torch.arange(-l, l + 1, dtype=alpha.dtype, device=alpha.device)
    return torch.cat([torch.sin(-m[:l] * alpha[..., None]), torch.cos(m[l:] * alpha[..., None])], dim=-1)


@torch.jit.script
def _calls_another(a: torch.Tensor, pieces: List[torch.Tensor]) -> torch.Tensor:
    return _by_device(a) + torch.stack(pieces).sum(0)


@torch.jit.script
def _scaled(x: torch.Tensor, scale: float, shape: List[int]) -> torch.Tensor:
    return (x * torch.tensor(scale) * round(-0.5)).reshape(shape + [-1])  # (3 is 3.0 here, round a float)


def _helper(x: torch.Tensor) -> torch.Tensor:
    if torch.jit.is_scripting():
        return x * 2
    return x * 3


@torch.jit.script
def _asks_scripting(x: torch.Tensor) -> torch.Tensor:
    return _helper(x) + 1


@torch.jit.script
def _from_mapping(d: Dict[str, torch.Tensor], nested: List[List[torch.Tensor]]) -> torch.Tensor:
    x = d["a"]
    return x + torch.arange(3, device=nested[0][0].device)


@torch.jit.script
def _draws(n: int) -> torch.Tensor:
    return torch.randn(n)


_DOUBLED = torch.jit.trace(lambda a: a * 2, torch.ones(3))


class _Gelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x) * x.new_ones(()).to(x.device)


class _Adds(torch.Tensor):
    """A subclass whose ``__torch_function__`` turns products into sums."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        func = torch.Tensor.add if func in (torch.Tensor.mul, torch.Tensor.__mul__, torch.mul) else func
        return super().__torch_function__(func, types, args, kwargs or {})


class _Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = torch.jit.script(_Gelu())  # (holds no tensors: it only computes)
        self.register_buffer("branch", _by_device(torch.arange(4.0)))
        self.register_buffer("beside", _ones_beside(self.lin.weight))
        self.register_buffer("grid", _harmonics(2, torch.linspace(0, 3, 5) * self.lin.bias[0]))
        self.register_buffer("nested", _calls_another(self.lin.bias, [self.lin.weight[0], torch.randn(4)]))
        self.register_buffer("scaled", _scaled(torch.ones(4, dtype=torch.int32), 3, (2,)))
        self.register_buffer("asks", _asks_scripting(self.lin.weight[1]))
        self.register_buffer("mapped", _from_mapping({"a": torch.randn(3)}, [[self.lin.bias]]))
        self.register_buffer("drawn", _draws(3) + torch.ops.aten.randn.default([2]).sum())
        self.register_buffer("traced", _DOUBLED(torch.randn(3)))
        self.register_buffer("activated", self.act(self.lin.weight))
        self.register_buffer("unclassed", _by_device(torch.ones(3).as_subclass(_Adds)) * 10)  # (TorchScript's: plain)


def test_torchscript_on_deferred_tensors_gives_eagers_tensors() -> None:
    """Each buffer was wrong before (branch: values; beside: meta after materialize; grid:
    torch's device error; scaled, asks: the Python function's values; drawn: the generator
    moved twice, an aten factory without ``device=`` drew for real; unclassed: the result kept
    the subclass, whose ``__torch_function__`` then ran on the product). Eager runs first, so
    the functions run their optimized graphs here, whose differentiable parts lost
    ``requires_grad``."""
    assert_same_as_eager(_Scripted, seeds=(0, 1))
    m = fxinit.materialize(fxinit.trace_init(_Scripted))
    assert not any(t.is_meta for t in m.buffers())


def test_a_scripted_function_in_an_init_step_after_the_trace() -> None:
    def step(m: nn.Module) -> None:
        with torch.no_grad():
            m.weight.copy_(_by_device(m.weight) + _harmonics(1, m.bias)[:, :1])

    assert_same_as_eager(lambda: nn.Linear(3, 3), seeds=(0,), post=step)


@torch.jit.script
def _sized_by_a_value(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(int(x.sum().item()), device=x.device)


class _SizedByAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", _sized_by_a_value(torch.randn(3)))


class _OnCuda(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", _by_device(torch.randn(3, device="cuda")))


class _HoldsAScriptedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.jit.script(nn.Linear(2, 2))


class _Holder(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.inner = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _HoldsItDeeper(nn.Module):
    """Found by a review: a scripted module without tensors of its own around one with them."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = torch.jit.script(_Holder(nn.Linear(2, 2)))


class _Listed(nn.Module):
    def __init__(self, tensors: List[torch.Tensor]) -> None:
        super().__init__()
        self.ts = tensors

    def forward(self, n: int) -> torch.Tensor:
        return self.ts[0] * (2 if self.ts[0].device.type == "cpu" else 5) + n


class _ListsTheModels(nn.Module):
    """Found by a review: the model's tensor in a list of a scripted module, which holds no
    parameter: kept deferred there (a backward gave the parameter a deferred gradient), and
    its device asked in a call without deferred arguments (other values)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.listed = torch.jit.script(_Listed([self.lin.bias]))


@torch.jit.script
class _Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@torch.jit.script
def _unboxed(box: _Box) -> torch.Tensor:
    return box.t * (3 if box.t.device.type == "cpu" else 5)


class _PassesABox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", _unboxed(_Box(torch.ones(3))))


@pytest.mark.parametrize("build, words", [
    (_OnCuda, "meant for cuda"), (_SizedByAValue, "reads values"), (_HoldsAScriptedLayer, "that holds tensors"),
    (_HoldsItDeeper, "that holds tensors"), (_ListsTheModels, "that holds tensors"), (_PassesABox, "asks the device")])
def test_torchscript_whose_values_cannot_be_recorded_is_refused_by_name(build: type, words: str) -> None:
    with pytest.raises(fxinit.DeferredInitError, match="TorchScript") as info:
        fxinit.trace_init(build)
    assert words in str(info.value)


def test_torchscript_fusing_on_the_cpu_is_refused_by_name() -> None:
    torch._C._jit_override_can_fuse_on_cpu(True)
    try:
        with pytest.raises(fxinit.DeferredInitError, match="fuses ops on the CPU"):
            fxinit.trace_init(lambda: nn.Module().register_buffer("b", _by_device(torch.randn(3))))
    finally:
        torch._C._jit_override_can_fuse_on_cpu(False)


def test_torchscript_without_deferred_arguments_is_torchscripts() -> None:
    m = fxinit.trace_init(nn.Linear, 2, 2)
    assert torch.equal(_asks_scripting(torch.zeros(2)), torch.full((2,), 1.0))  # the interpreter's answer
    assert torch.equal(_scaled(torch.ones(2, dtype=torch.int32), 3, [2]), torch.full((2, 1), -0.0))
    fxinit.materialize(m)


class _CallsWrongly(nn.Module):
    def __init__(self, call: str) -> None:
        super().__init__()
        w = torch.randn(3)
        calls = {"extra": lambda: _by_device(w, 2), "unknown": lambda: _by_device(w, b=2),
                 "twice": lambda: _by_device(w, a=w), "missing": lambda: _harmonics(alpha=w)}
        self.register_buffer("b", calls[call]())


@pytest.mark.parametrize("call", ["extra", "unknown", "twice", "missing"])
def test_a_call_torchscript_refuses_is_refused_as_in_eager(call: str) -> None:
    """Found by a review: binding the arguments to run TorchScript afresh let through calls its
    own binding refuses (extra, unknown, repeated, missing arguments)."""
    with pytest.raises(RuntimeError) as eager:
        _CallsWrongly(call)
    with pytest.raises(RuntimeError) as traced:
        fxinit.trace_init(_CallsWrongly, call)
    assert str(traced.value) == str(eager.value)
