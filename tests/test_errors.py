"""What cannot be deferred fails loudly: a DeferredInitError that names the op, the module path
and the user's file and line (test_failed_materialize.py: a failing materialize leaves nothing half initialized)."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import fxinit
from conftest import assert_modules_equal, assert_same_as_eager, same_bits
from test_failed_materialize import _all_deferred, _missing_device

_THIS = os.path.abspath(__file__)


def _line(marker: str) -> int:
    """Line number of the (unique) line of this file that carries ``# <marker>``."""
    with open(_THIS) as f:
        hits = [i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


# Each offending module is built as ``self.block`` of a Parent, so its path is "...block".
# fxinit computes small values exactly while recording (see test_small_values_are_exact), so
# the refused cases use tensors whose computation costs more than its 16 MiB budget.
BIG = (2048, 2049)
class ItemOnRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(BIG))
        self.scale = self.w[0, 0].item()  # ERR:item


class IfOnRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(BIG))
        if self.w.sum() > 0:  # ERR:if
            self.sign = 1


class NonzeroOnRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(BIG))
        self.register_buffer("idx", torch.nonzero(self.w > 0))  # ERR:nonzero


class TolistOnLarge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        big = torch.linspace(0, 1, 5_000_000)  # beyond the budget for computing values
        self.values = big.tolist()  # ERR:tolist


class TolistOnRandom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(BIG))
        self.values = self.w.tolist()  # ERR:tolist_random


class DataPtr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.ptr = self.w.data_ptr()  # ERR:data_ptr


class UntypedStorage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.st = self.w.untyped_storage()  # ERR:untyped_storage


class FromDlpack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.arr = np.from_dlpack(self.w.detach())  # ERR:dlpack


class ToDlpack(nn.Module):  # DGL hands its index tensors to C++ so (zerocopy_to_dgl_ndarray)
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.capsule = torch.utils.dlpack.to_dlpack(torch.tensor([0, 1, 2]))  # ERR:to_dlpack


class Numpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(BIG))
        self.arr = self.w.detach().numpy()  # ERR:numpy


class Parent(nn.Module):
    def __init__(self, cls) -> None:
        super().__init__()
        self.pre = nn.Linear(2, 2)
        self.block = cls()


ERROR_CASES = [
    ("item", ItemOnRandom, ("item",)),
    ("if", IfOnRandom, ("bool", "if ", "is_nonzero", "_local_scalar_dense")),
    ("nonzero", NonzeroOnRandom, ("nonzero",)),
    ("tolist", TolistOnLarge, ("tolist",)),
    ("tolist_random", TolistOnRandom, ("tolist",)),
    ("data_ptr", DataPtr, ("data_ptr",)),
    ("untyped_storage", UntypedStorage, ("untyped_storage",)),
    ("numpy", Numpy, ("numpy",)),
    ("dlpack", FromDlpack, ("__dlpack",)),
    ("to_dlpack", ToDlpack, ("to_dlpack",)),
]


@pytest.mark.parametrize("marker,cls,op_names", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_data_dependent_constructor_raises_a_precise_error(marker, cls, op_names) -> None:
    torch.manual_seed(0)
    Parent(cls)  # eager construction works
    eager_rng = torch.get_rng_state()
    torch.manual_seed(0)
    with pytest.raises(fxinit.DeferredInitError) as info:
        fxinit.trace_init(Parent, cls)
    exc = info.value
    msg = str(exc)
    assert any(name in msg for name in op_names), f"the op ({op_names}) is not named in:\n{msg}"
    assert "block" in msg, f"the module path (Parent.block) is not named in:\n{msg}"
    where = f"test_errors.py:{_line('ERR:' + marker)}"
    assert where in msg, f"the source line {where} is not named in:\n{msg}"
    assert exc.module is not None and "block" in exc.module
    assert exc.source is not None and where in exc.source
    del eager_rng


def test_error_outside_any_module_names_the_line() -> None:
    with pytest.raises(fxinit.DeferredInitError) as info:
        with fxinit.meta_init():
            t = torch.randn(BIG)
            t.max().item()  # ERR:meta_init_item
    assert f"test_errors.py:{_line('ERR:meta_init_item')}" in str(info.value)


def test_error_in_reinit_after_trace_names_the_line() -> None:
    m = fxinit.trace_init(nn.Linear, *BIG)
    with pytest.raises(fxinit.DeferredInitError) as info:
        m.weight.abs().data_ptr()  # ERR:after_trace
    assert f"test_errors.py:{_line('ERR:after_trace')}" in str(info.value)
    assert fxinit.is_deferred(m.weight)
    top = float(m.weight.abs().max())  # a value read after the trace is computed, whatever it costs
    fxinit.materialize(m)  # the model is still usable
    assert top == float(m.weight.abs().max())


def test_small_constant_values_are_answered_not_refused() -> None:
    """The other side of the rule: values computed only from small constants are known."""

    class SmallConstants(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n = int(torch.tensor([1, 2, 3]).sum().item())
            self.xs = torch.linspace(0, 1, 5).tolist()
            self.nz = torch.nonzero(torch.tensor([0, 1, 0, 1])).flatten().tolist()
            self.w = nn.Parameter(torch.zeros(self.n))

    ref = SmallConstants()
    m = fxinit.trace_init(SmallConstants)
    assert (m.n, m.xs, m.nz) == (ref.n, ref.xs, ref.nz)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


class SmallValues(nn.Module):
    """Data-dependent Python on small random tensors: answered with the eager values."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.scale = self.w[0, 0].item()
        self.positive = bool(self.w.sum() > 0)
        self.register_buffer("idx", torch.nonzero(self.w > 0))
        self.values = self.w.detach().numpy().tolist()
        self.b = nn.Parameter(torch.randn(3) * self.scale)


def test_small_values_are_exact() -> None:
    torch.manual_seed(0)
    ref = SmallValues()
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    m = fxinit.trace_init(SmallValues)
    assert torch.equal(torch.get_rng_state(), after_eager)
    assert (m.scale, m.positive, m.values) == (ref.scale, ref.positive, ref.values)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


def test_pickling_a_deferred_tensor_raises() -> None:
    m = fxinit.trace_init(nn.Linear, 3, 3)
    with pytest.raises(fxinit.DeferredInitError):
        pickle.dumps(m.weight)


def test_mixing_two_traces_raises() -> None:
    a = fxinit.trace_init(nn.Linear, 3, 3)
    b = fxinit.trace_init(nn.Linear, 3, 3)
    with pytest.raises(fxinit.DeferredInitError):
        with torch.no_grad():
            a.weight.add_(b.weight)


def test_trace_init_of_a_non_module_raises_type_error() -> None:
    with pytest.raises(TypeError):
        fxinit.trace_init(lambda: torch.zeros(3))


def test_random_op_for_a_missing_device_fails_at_trace_time() -> None:
    dev = _missing_device()

    class RandomOnDevice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # CUDA's generator is followed without CUDA for the ops whose offsets fxinit knows
            # (tests/test_cuda_target.py); randperm's it does not
            self.register_buffer("r", torch.randperm(3, device=dev))  # ERR:missing_device

    with pytest.raises(fxinit.DeferredInitError) as info:
        fxinit.trace_init(RandomOnDevice)
    assert f"test_errors.py:{_line('ERR:missing_device')}" in str(info.value)
    assert dev in str(info.value)


def test_numpy_array_input_is_not_an_error() -> None:
    class FromNumpy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("a", torch.from_numpy(np.arange(4.0)))

    ref = FromNumpy()
    m = fxinit.trace_init(FromNumpy)
    fxinit.materialize(m)
    assert same_bits(m.a, ref.a)


@pytest.mark.parametrize("init, message", [
    (lambda w: nn.init.normal_(w, 0.0, -1.0), "normal expects std >= 0.0"),
    (lambda w: nn.init.uniform_(w, 1.0, 0.0), "uniform_ expects to return a [from, to) range"),
])
def test_invalid_init_arguments_fail_at_trace_time_as_in_eager(init, message: str) -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(64, 64))
            init(self.w)

    with pytest.raises(RuntimeError, match=re.escape(message)):
        Bad()
    with pytest.raises(fxinit.DeferredInitError, match=re.escape(message)) as info:
        fxinit.trace_init(Bad)
    assert "eager construction raises this error too" in str(info.value)


def test_calling_a_deferred_model_says_so_until_it_is_materialized() -> None:
    net = fxinit.trace_init(lambda: nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    x = torch.ones(1, 4)
    with pytest.raises(fxinit.DeferredInitError, match=r"was called while its tensors are deferred .*'0.weight'"):
        net(x)
    fxinit.materialize(net[0])
    net[0](x)  # a materialized part runs
    with pytest.raises(fxinit.DeferredInitError, match=r"^2 was called while"):
        net[2](x)
    fxinit.materialize(net)
    assert net(x).shape == (1, 2)
    assert not any(m._forward_pre_hooks for m in net.modules())  # the guards removed themselves


def test_a_materialized_model_holds_no_guard_and_saves_and_scripts_as_eager() -> None:
    """The guards go with materialize, not with the first call (found by a sweep of
    flash-linear-attention: a materialized model never called kept a closure hook in every
    module, so ``torch.save(model)`` and ``torch.jit.script`` raised where eager's work)."""
    import io

    net = fxinit.trace_init(lambda: nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    fxinit.materialize(net[2])
    assert not net[2]._forward_pre_hooks and net[0]._forward_pre_hooks  # the part still deferred keeps its own
    fxinit.materialize(net)
    assert not any(m._forward_pre_hooks for m in net.modules())
    torch.save(net, io.BytesIO())
    assert torch.equal(pickle.loads(pickle.dumps(net))[0].weight, net[0].weight)
    torch.jit.script(net)


def test_arguments_are_checked_at_the_door() -> None:
    """A wrong seed, dtype or device raises before any value is computed; dtype names work."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 3).to(torch.bfloat16)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 3, 3)
    with pytest.raises(TypeError, match="seed='x'"):
        fxinit.materialize(m, rng="portable", seed="x")
    with pytest.raises(TypeError, match="seed=1.5"):
        fxinit.materialize(m, rng="portable", seed=1.5)
    with pytest.raises(ValueError, match="names no torch dtype"):
        fxinit.materialize(m, dtype="bfloat")
    with pytest.raises(TypeError, match="floating-point or complex"):
        fxinit.materialize(m, dtype="int64")
    missing = next(d for d in ("cuda", "xpu", "mps") if not getattr(torch, d).is_available())
    with pytest.raises(fxinit.DeferredInitError, match=f"device='{missing}' is not available"):
        fxinit.materialize(m, device=missing)
    graph = fxinit.init_graph(m)
    with pytest.raises(TypeError, match="seed"):
        graph.materialize(rng="portable", seed="1")
    assert _all_deferred(m)  # nothing was computed
    fxinit.materialize(m, dtype="bfloat16")
    assert_modules_equal(m, ref)


def test_a_kernel_that_touches_memory_itself_is_refused_by_name() -> None:
    """``SobolEngine`` fills its state with a kernel that writes memory directly, below any op
    the capture sees: eager builds it; fxinit refuses it by name rather than with torch's
    message about unallocated data."""
    class Anchors(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("points", torch.quasirandom.SobolEngine(3, scramble=True).draw(8))

    Anchors()
    refused = r"cannot defer torch\._sobol_engine_initialize_state_: its kernel reads or writes the tensor's memory"
    with pytest.raises(fxinit.DeferredInitError, match=refused) as caught:
        fxinit.trace_init(Anchors)
    assert "fxinit.is_meta_init()" in str(caught.value)


def test_composites_after_the_trace_point_to_recording() -> None:
    """After the trace a composite op builds its helper tensors like its input, on the meta
    storage of a deferred tensor (found by a hunt: peft's pissa_niter_4 through
    torch.svd_lowrank): refused with the way out, which gives eager's values."""
    def step(m: nn.Module) -> None:
        with torch.no_grad():
            m.weight.copy_(m.weight - torch.quantile(m.weight, 0.5))
            m.weight.add_(torch.svd_lowrank(m.weight, q=2)[0].sum())

    torch.manual_seed(0)
    eager = nn.Linear(4, 8)
    step(eager)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 4, 8)
    with pytest.raises(fxinit.DeferredInitError, match=r"composite op .*torch.quantile.*fxinit.recording"):
        step(m)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 4, 8)
    with fxinit.recording(m):
        step(m)
    fxinit.materialize(m)
    assert torch.equal(m.weight, eager.weight)


def test_a_deferred_number_formats_as_eagers() -> None:
    """``f"{t:.4f}"`` of a 0-dim deferred tensor (a logging line in a constructor) is its number,
    as in eager; it raised a TypeError."""
    notes = {}

    class Logged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 6)
            notes[fxinit.is_meta_init()] = f"{self.lin.weight.sum():.6f} {self.lin.bias[0]:+.3e}"

    torch.manual_seed(0)
    Logged()
    torch.manual_seed(0)
    fxinit.trace_init(Logged)
    assert notes[True] == notes[False]


def test_lobpcg_after_the_trace_is_refused_with_the_way_out() -> None:
    m = fxinit.trace_init(nn.Linear, 6, 6)
    with pytest.raises(fxinit.DeferredInitError, match="(?s)after the trace needed a value.*fxinit.recording"):
        with torch.no_grad():
            torch.lobpcg(m.weight @ m.weight.T, k=1)


def test_copies_of_deferred_tensors_as_eager_or_refused() -> None:
    """Found by a hunt on Python protocols in constructors: deepcopy copied a non-leaf eager
    refuses to, and copy.copy spoke of pickling; numpy() of a tensor that requires grad gave
    an array. (Deep copies themselves: tests/test_deepcopy.py.)"""
    import copy

    m = fxinit.trace_init(nn.Linear, 3, 2)
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(m.weight * 2)
    with pytest.raises(fxinit.DeferredInitError, match="copy.copy of a deferred tensor"):
        copy.copy(m.weight)
    with pytest.raises(RuntimeError, match="Can't call numpy"):
        m.weight.numpy()
    with torch.no_grad():
        assert m.weight.numpy().shape == (2, 3)  # as eager: only with grad enabled
    assert copy.deepcopy(m).weight.shape == (2, 3)


class _ViewOfWrittenWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1, bias=False)
        self.register_buffer("tiled", self.lin.weight.expand(2, 1, 1))  # view
        with torch.no_grad():
            self.lin.weight[0].zero_()  # written through another view


def test_a_view_of_a_parameter_written_then_frozen_is_refused_not_an_internal_assert() -> None:
    """Found by the fuzzer (seed 510): torch cannot regenerate such a view's grad_fn on a
    deferred tensor (an internal assert), and eager's cannot be rebuilt: refused by name.
    Read before the freeze, or frozen after materialize, it materializes as eager's values."""
    torch.manual_seed(0)
    m = fxinit.trace_init(_ViewOfWrittenWeight)
    m.requires_grad_(False)
    with pytest.raises(fxinit.DeferredInitError, match="written in place through another view and then frozen"):
        fxinit.materialize(m)
    torch.manual_seed(0)
    eager = _ViewOfWrittenWeight()
    torch.manual_seed(0)
    m = fxinit.trace_init(_ViewOfWrittenWeight)
    fxinit.materialize(m)
    assert torch.equal(m.tiled, eager.tiled) and m.tiled.data_ptr() == m.lin.weight.data_ptr()


@pytest.mark.parametrize("make", ["quantize_per_tensor", "quantized Linear"])
def test_quantized_tensors_are_refused_by_name(make: str) -> None:
    """torch's meta kernels give quantized tensors no quantized dtype (``quantize_per_tensor``
    says float32) or none at all: refused by name, not an internal error (found by a hunt
    through torchvision's ``quantize=True`` models)."""
    class Quantized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if make == "quantize_per_tensor":
                self.register_buffer("q", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))
            else:
                self.inner = torch.ao.nn.quantized.Linear(4, 4)

    with pytest.raises(fxinit.DeferredInitError, match="cannot defer quantized tensors"):
        fxinit.trace_init(Quantized)


@torch.compile(backend="eager")  # Dynamo alone: what traces into the capture
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


class CompiledInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        with torch.no_grad():
            self.w.copy_(_scaled(self.w))  # the line the refusal names


def test_a_compiled_function_in_the_constructor_is_refused_by_name() -> None:
    """torch.compile traces into the capture and fails there: a refusal naming the caller's
    line, not Dynamo's internal error (the compiled kernels' values are not what a recording
    of torch ops replays)."""
    with pytest.raises(fxinit.DeferredInitError, match="torch.compile'd function") as info:
        fxinit.trace_init(CompiledInInit)
    assert info.value.source is not None and info.value.source.endswith(
        f"test_errors.py:{CompiledInInit.__init__.__code__.co_firstlineno + 4}")
    _scaled(torch.ones(2))  # torch.compile still works after it
    fxinit.materialize(fxinit.trace_init(nn.Linear, 2, 2))


@torch.compile(backend="eager")
def _normalized_(w: torch.Tensor) -> torch.Tensor:
    return w.div_(w.norm(dim=1, keepdim=True))  # the line the refusal names


def test_a_compiled_init_step_after_the_trace_is_refused_by_name() -> None:
    """An init step after the trace that calls a compiled function on deferred tensors: eager's
    values are the compiled kernels' (Inductor's fused norm here differs from eager's ops in
    the last bit), so it is refused, where Dynamo used to fall back to the ops one by one and
    fxinit recorded them, silently other bits."""
    m = fxinit.trace_init(nn.Linear, 8, 4)
    with pytest.raises(fxinit.DeferredInitError, match="torch.compile'd function") as info, torch.no_grad():
        _normalized_(m.weight)
    assert f"test_errors.py:{_normalized_.__wrapped__.__code__.co_firstlineno + 2}: " in (info.value.source or "")
    fxinit.materialize(m)  # the recording goes on: the write was not recorded
    with torch.no_grad():
        _normalized_(m.weight)  # and the compiled function works on the real tensor


def test_provenance_skips_deprecation_wrappers() -> None:
    """``nn.utils.weight_norm`` is wrapped by ``typing_extensions.deprecated``: the ops it records
    name the caller's line, not the wrapper's."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        m = fxinit.trace_init(lambda: nn.utils.weight_norm(nn.Linear(4, 4)))
    sources = {n.meta["prov"].source for n in fxinit.init_graph(m).nodes if n.meta["prov"].init_fn is None}
    assert sources and all(s and "typing_extensions" not in s for s in sources), sources
    assert any(s.startswith(f"{__file__}:") for s in sources), sources


def test_values_read_after_the_trace_are_computed_whatever_they_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmengine's ``init_weights`` compares each parameter's mean before and after (found by an
    mmengine sweep: refused for any parameter over 16 MiB). While recording, a read costlier
    than the budget is refused, which keeps a trace cheap; after it, an init step reads what
    eager's reads."""
    from fxinit.capture import shadows

    monkeypatch.setattr(shadows, "EVAL_BUDGET", 64)  # (as a parameter over 16 MiB)

    class ReadsWhileRecording(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.positive = bool(self.lin.weight.sum() > 0)

    with pytest.raises(fxinit.DeferredInitError, match="too large to compute while recording"):
        fxinit.trace_init(ReadsWhileRecording)

    def init_weights(m: nn.Module) -> list[bool]:  # mmengine's bookkeeping, then an init, then again
        means = {p: p.data.mean().cpu() for p in m.parameters()}
        nn.init.normal_(m.weight, std=0.02)
        return [bool(means[p] != p.data.mean()) for p in m.parameters()] + [float(m.weight.sum()) > 0]

    torch.manual_seed(0)
    eager = nn.Linear(8, 8)
    want = init_weights(eager)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 8, 8)
    assert init_weights(m) == want
    assert_modules_equal(fxinit.materialize(m), eager)


def test_a_value_read_while_recording_costs_what_its_slice_holds_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """e3nn's ``normalize2mom`` reads ``act(randn(1_000_000, float64)).pow(2).mean().item()``
    in every activation's constructor (found by an e3nn sweep: refused, as three 8 MB tensors
    summed over the 16 MiB budget; two are held at once). The budget counts what a run of the
    slice holds at once, which is what computing the value costs."""
    from fxinit.capture import shadows

    monkeypatch.setattr(shadows, "EVAL_BUDGET", 20_000)  # (as 16 MiB for 1M float64 elements)

    class Normalized(nn.Module):
        def __init__(self, chained: bool) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            z = torch.randn(1000, dtype=torch.float64, generator=g)
            # chained: each 8000-byte step frees the one before; else all three are held at once
            x = torch.tanh(z).pow(2) if chained else torch.tanh(z) + z.pow(2) * z.sin()
            self.cst = x.mean().item()
            self.lin = nn.Linear(2, 2)

    assert_same_as_eager(Normalized, True, seeds=(0,), orders=("whole",))
    with pytest.raises(fxinit.DeferredInitError, match="too large to compute"):
        fxinit.trace_init(Normalized, False)


def test_a_parameter_written_into_a_callers_tensor_with_autograd_on_is_refused() -> None:
    """``arg.copy_(self.w)`` with grad enabled: eager's ``arg`` leads its gradient to ``w``,
    fxinit's led it to the deferred tensor, and ``w`` got none, silently (fuzzer seed 22).
    Under ``torch.no_grad()`` it is written, as eager's."""
    class Writes(nn.Module):
        def __init__(self, arg: torch.Tensor, grad: bool) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))
            with torch.set_grad_enabled(grad):
                arg.copy_(self.w)

    with pytest.raises(fxinit.DeferredInitError, match="requires grad into a real tensor with autograd on"):
        fxinit.trace_init(Writes, torch.ones(2, 3), True)
    arg = torch.ones(2, 3)
    m = fxinit.materialize(fxinit.trace_init(Writes, arg, False))
    assert torch.equal(arg, torch.zeros(2, 3)) and arg.grad_fn is None and m.w.requires_grad


class _PackedInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)
        x = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 7, 4), torch.tensor([7, 5, 2]), batch_first=True)
        with torch.no_grad():
            self.register_buffer("stat", self.rnn(x)[0].data.mean(0))  # packed-lstm


def test_a_recurrent_layer_over_a_packed_sequence_is_refused_naming_it() -> None:
    """Found by a sweep of audio models: refused by name, the reason blamed the kernel alone;
    it is the packed overload (a padded input is recorded)."""
    with pytest.raises(fxinit.DeferredInitError, match="torch.lstm over a PackedSequence") as info:
        fxinit.trace_init(_PackedInInit)
    assert info.value.source.endswith("# packed-lstm") and "LSTM" in (info.value.module or "")


def test_init_graph_of_a_lazy_module_before_its_dry_run_is_refused_by_name() -> None:
    """Found by a sweep of torch_geometric (``Linear(-1, 4)``): a ValueError from torch's
    uninitialized parameter, raised while copying it into the graph."""
    m = fxinit.trace_init(lambda: nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(2)))
    with pytest.raises(fxinit.DeferredInitError, match="1.weight is an uninitialized parameter of a lazy module"):
        fxinit.init_graph(m)
    fxinit.dry_run(m, torch.zeros(1, 4))
    assert set(fxinit.init_graph(m).materialize()) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def _native_first(t: torch.Tensor) -> torch.Tensor:
    """Stands for a C/C++ extension function (pybind11): it reads ``t``'s memory with no torch
    hook seeing the call, and torch raises this when the memory is a deferred tensor's (checked
    with a ``load_inline`` extension and torch-harmonics' ``disco_helpers.preprocess_psi``)."""
    if fxinit.is_deferred(t):
        raise RuntimeError("The tensor has a non-zero number of elements, but its data is not allocated yet.\n"
                           "If you're using torch.compile/export/fx, it is likely that we are erroneously tracing "
                           "into a custom kernel.")
    return t[:1].clone()


def test_native_code_reading_a_deferred_tensor_is_refused_with_the_calling_line() -> None:
    """A C/C++ extension called on a deferred tensor in a constructor: torch's own error named
    nothing of the caller's (a torch-harmonics sweep: every DISCO convolution built with its
    optimized kernel)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = torch.randn(4)
            self.register_buffer("b", _native_first(w))

    M()
    with pytest.raises(fxinit.DeferredInitError, match="native code outside torch's ops") as caught:
        fxinit.trace_init(M)
    assert "test_errors.py" in caught.value.source and "after fxinit.materialize" in str(caught.value)


class _Doubling(TorchDispatchMode):
    """A mode that changes results: every ``randn`` comes out doubled."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.ops.aten.randn.default else out


class _Drawn(nn.Module):
    def __init__(self, inside: Any = None) -> None:
        super().__init__()
        with inside if inside is not None else contextlib.nullcontext():
            self.register_buffer("b", torch.randn(3))
            self.lin = nn.Linear(3, 3)


def test_a_dispatch_mode_entered_before_the_trace_is_refused_by_name() -> None:
    """A ``TorchDispatchMode`` of the caller's around ``trace_init`` sits below fxinit's capture: what it
    does to the constructor's ops was lost, silently (doubled ``randn`` values came out single,
    ``FlopCounterMode`` counted 0, ``FakeTensorMode``'s fakes came out real; a hunt found it)."""
    for mode in (_Doubling(), FlopCounterMode(display=False), FakeTensorMode()):
        with mode, pytest.raises(fxinit.DeferredInitError, match="TorchDispatchMode entered before the trace"):
            fxinit.trace_init(_Drawn)


def test_a_dispatch_mode_entered_inside_the_constructor_sees_its_ops_as_in_eager() -> None:
    torch.manual_seed(0)
    eager = _Drawn(_Doubling())
    torch.manual_seed(0)
    traced = fxinit.trace_init(_Drawn, _Doubling())
    fxinit.materialize(traced)
    assert torch.equal(traced.b, eager.b) and torch.equal(traced.lin.weight, eager.lin.weight)
    with pytest.raises(fxinit.DeferredInitError, match="FakeTensorMode is active inside the traced constructor"):
        fxinit.trace_init(_Drawn, FakeTensorMode())


def test_pickling_a_deferred_tensor_names_it() -> None:
    """A module whose ``__deepcopy__`` pickles what it holds (e3nn's generated code) met a refusal
    that named no tensor: the message names it where the model holds it, and the source line."""
    m = fxinit.trace_init(nn.Linear, 2, 2)
    with pytest.raises(fxinit.DeferredInitError, match=r"a deferred tensor \(weight\) cannot be pickled") as info:
        pickle.dumps(m.weight)
    assert "test_errors.py" in str(info.value)
