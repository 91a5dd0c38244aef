"""Wrapper tensor subclasses around deferred tensors (``reachable.inner_tensors``).

torchtune's QLoRA base weights are torchao ``NF4Tensor`` parameters: ``to_nf4(weight)`` in
``__init__`` builds a wrapper subclass (``__tensor_flatten__``) around tensors computed from the
deferred weight, and ``torchao.quantize_`` does the same to a built model. The wrapper object
is no deferred tensor itself, so materialize once left its inner tensors deferred while
``is_deferred`` said False (found by a hunt on torchtune 0.6.1). ``Scaled`` below is such a
subclass in a few lines (int8 values and a scale, computed in ``__init__``); the tests compare
with eager construction through ``fxinit.check``, which compares wrapper subclasses inner
tensor by inner tensor (their own ops may not include comparing).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

import fxinit
from fxinit.check import compare_tensors
from fxinit.errors import DeferredInitError


class Scaled(torch.Tensor):
    """``q * scale``: int8 values and a float scale, dequantized for any op but ``detach``."""

    @staticmethod
    def __new__(cls, q: torch.Tensor, scale: torch.Tensor, device: torch.device | None = None) -> "Scaled":
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=scale.dtype,
                                                   device=q.device if device is None else device)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, device: torch.device | None = None) -> None:
        self.q, self.scale = q, scale

    def __tensor_flatten__(self) -> tuple[list[str], dict]:
        return ["q", "scale"], {}

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: dict, size: torch.Size, stride: tuple) -> "Scaled":
        return Scaled(inner["q"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.detach.default:  # on its own device, as torchao's NF4Tensor does
            return cls(args[0].q.detach(), args[0].scale.detach(), args[0].device)
        dequantized = tree_map(lambda x: x.q.to(x.scale.dtype) * x.scale if isinstance(x, Scaled) else x,
                               (args, kwargs or {}))
        return func(*dequantized[0], **dequantized[1])


def quantized(w: torch.Tensor) -> Scaled:
    scale = w.detach().abs().amax() / 127
    return Scaled(torch.round(w.detach() / scale).to(torch.int8), scale)


class QuantLinear(nn.Module):
    """A frozen quantized base weight, a trainable bias, and an inner subclass in a buffer."""

    def __init__(self, n: int = 16, m: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(quantized(torch.randn(m, n)), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(m))
        self.register_buffer("codebook", quantized(torch.linspace(-1, 1, 16) * torch.rand(16)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


class Held(nn.Module):
    """Wrapper subclasses as a plain attribute and in a list attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.table = quantized(torch.randn(5))
        self.tables = [quantized(torch.randn(3)), torch.ones(2)]


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = QuantLinear()
        self.b = nn.Sequential(QuantLinear(8, 4), nn.Linear(4, 4))


def test_wrapper_subclasses_held_as_attributes() -> None:
    report = fxinit.check(Held)
    assert report.ok and report.tensors_checked == 3, report
    m = fxinit.trace_init(Held)
    fxinit.materialize(m)
    assert not fxinit.is_deferred(m.table.q) and not fxinit.is_deferred(m.tables[0].scale)


@pytest.mark.parametrize("model", [QuantLinear, Nested])
def test_tensors_inside_wrapper_subclasses_materialize_exactly(model) -> None:
    report = fxinit.check(model)
    assert report.ok, report
    torch.manual_seed(0)
    m = fxinit.trace_init(model)
    assert fxinit.is_deferred(m)
    first = m.get_submodule("a" if model is Nested else "")
    assert fxinit.is_deferred(first.weight) and type(first.weight) is Scaled
    fxinit.materialize(first)  # a part first, then the rest
    assert not fxinit.is_deferred(first.weight) and not fxinit.is_deferred(first.codebook.q)
    fxinit.materialize(m)
    assert not fxinit.is_deferred(m)
    torch.manual_seed(0)
    eager = model()
    x = torch.randn(3, 16)
    assert torch.equal(m(x) if model is QuantLinear else m.a(x), eager(x) if model is QuantLinear else eager.a(x))


def test_a_wrapper_tensor_materializes_alone() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(QuantLinear)
    weight = m.weight
    assert fxinit.materialize(weight) is weight and not fxinit.is_deferred(weight)
    torch.manual_seed(0)
    assert compare_tensors("weight", weight, QuantLinear().weight) is None
    assert fxinit.is_deferred(m)  # the rest is still deferred


def test_quantizing_after_the_trace() -> None:
    """A step after the trace that swaps in wrapper subclasses (as ``torchao.quantize_`` does)."""
    def quantize(model: nn.Module) -> None:
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                mod.weight = nn.Parameter(quantized(mod.weight), requires_grad=False)

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    quantize(eager)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Sequential, nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    quantize(m)
    fxinit.materialize(m)
    for name in ("0.weight", "2.weight", "0.bias"):
        got, want = m.get_parameter(name), eager.get_parameter(name)
        assert compare_tensors(name, got, want) is None, name


def test_the_comparison_sees_inner_tensors() -> None:
    torch.manual_seed(0)
    a = QuantLinear()
    torch.manual_seed(0)
    b = QuantLinear()
    assert compare_tensors("weight", a.weight, b.weight) is None
    b.weight.q[0, 0] += 1
    d = compare_tensors("weight", a.weight, b.weight)
    assert d is not None and d.name == "weight.q" and d.what == "values"


@pytest.mark.parametrize("kwargs, what", [
    (dict(dtype=torch.bfloat16), "dtype="),
    (dict(state_dict={}), "state_dict="),
    (dict(device="meta"), None),  # no values anywhere: nothing to imitate
])
def test_changing_a_wrapper_subclass_is_refused_by_name(kwargs, what) -> None:
    m = fxinit.trace_init(Nested)
    if what is None:
        fxinit.materialize(m, **kwargs)
        assert m.a.weight.q.is_meta
        return
    with pytest.raises(DeferredInitError, match=rf"materialize\({what}\).*\(a\.weight\.q, and 7 more\)"):
        fxinit.materialize(m, **kwargs)
    assert fxinit.is_deferred(m.a.weight)  # nothing was done


class AsksInside(Scaled):
    """Builds ``detach``'s result on the device its inner tensor reports inside
    ``__torch_dispatch__`` (torchao's float8 training weights do)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.detach.default:
            return cls(args[0].q.detach(), args[0].scale.detach())
        return super().__torch_dispatch__(func, types, args, kwargs)


class AsksInsideLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        w = torch.randn(4, 4)
        self.weight = nn.Parameter(AsksInside(w.to(torch.int8), w.abs().amax()), requires_grad=False)


class AsksWithoutTorchFunction(nn.Module):
    """The same, built where subclasses' ``__torch_function__`` is off: a deferred tensor is
    meta underneath, and says so there."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.randn(4, 4)
        with torch._C.DisableTorchFunctionSubclass():
            self.weight = nn.Parameter(AsksInside(w.to(torch.int8), w.abs().amax()), requires_grad=False)


def test_a_wrapper_built_in_its_own_torch_dispatch_has_eagers_device() -> None:
    """Inside a wrapper subclass's ``__torch_dispatch__`` eager's ``__torch_function__`` is on, so
    a deferred tensor says its device there (found by a sweep of torchao: the recorder's own
    guard was still on there, and ``convert_to_float8_training`` with FSDP's float8 all-gather in
    ``__init__`` was refused)."""
    assert AsksInsideLinear().weight.device.type == "cpu"  # eager's
    report = fxinit.check(AsksInsideLinear)
    assert report.ok, report
    m = fxinit.trace_init(AsksInsideLinear)
    fxinit.materialize(m)
    assert m.weight.device.type == "cpu" and not fxinit.is_deferred(m.weight.q)


def test_a_wrapper_built_on_meta_is_refused_by_name() -> None:
    assert AsksWithoutTorchFunction().weight.device.type == "cpu"  # eager's
    m = fxinit.trace_init(AsksWithoutTorchFunction)
    with pytest.raises(DeferredInitError, match=r"AsksInside weight is a wrapper tensor subclass .* on 'meta'"):
        fxinit.materialize(m)


class AliasesItsDetach(Scaled):
    """Runs ops with subclasses' ``__torch_function__`` off and aliases ``detach``'s result to
    its input (``return_and_correct_aliasing``), as torchao's quantized weights do."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        from torch.utils._python_dispatch import return_and_correct_aliasing
        if func is torch.ops.aten.detach.default:
            out = cls(func(args[0].q), func(args[0].scale))
            return return_and_correct_aliasing(func, args, kwargs or {}, out)
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_a_parameter_of_a_wrapper_that_detaches_on_meta_is_refused_by_name() -> None:
    """torchao's ``quantize_(model, Int8WeightOnlyConfig())`` of a traced model: ``nn.Parameter``
    of its wrapper detaches on meta, and torch 2.13's aliasing fix-up then failed with a device
    error (found by a sweep of torchao 0.18). Eager's works; fxinit names it there, and on
    torch 2.15, whose fix-up accepts it, gives eager's wrapper."""
    def quantize(m: nn.Linear) -> None:
        w = m.weight.detach()
        scale = w.abs().amax() / 127
        m.weight = nn.Parameter(AliasesItsDetach(torch.round(w / scale).to(torch.int8), scale), requires_grad=False)

    torch.manual_seed(0)
    eager = nn.Linear(8, 4)
    quantize(eager)
    assert eager.weight.device.type == "cpu"
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 8, 4)
    try:
        quantize(m)
    except DeferredInitError as exc:  # torch 2.13's aliasing fix-up fails across the devices; 2.15's does not
        assert re.search(r"Parameter\(AliasesItsDetach\) around deferred tensors.*\n.*\n"
                         r"  hint:   quantize after fxinit.materialize", str(exc)), exc
        fxinit.materialize(m)  # untouched: materialize first, then quantize, works
        quantize(m)
    else:
        fxinit.materialize(m)
    assert type(m.weight) is AliasesItsDetach and m.weight.device == eager.weight.device
    assert torch.equal(m.weight.q, eager.weight.q) and torch.equal(m.weight.scale, eager.weight.scale)


def test_init_graph_refuses_wrapper_subclasses() -> None:
    m = fxinit.trace_init(Nested)
    with pytest.raises(DeferredInitError, match=r"inside wrapper tensor subclasses \(a\.weight\.q, a\.weight\.scale"):
        fxinit.init_graph(m)


class Box(torch.Tensor):
    """A wrapper of one tensor, to nest and to hold anywhere."""

    @staticmethod
    def __new__(cls, x: torch.Tensor, device: torch.device | None = None) -> "Box":
        return torch.Tensor._make_wrapper_subclass(cls, x.shape, dtype=x.dtype, device=device or x.device)

    def __init__(self, x: torch.Tensor, device: torch.device | None = None) -> None:
        self.x = x

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["x"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: None, size: torch.Size, stride: tuple) -> "Box":
        return Box(inner["x"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        """Every result wrapped again, on the device of the Box it came from (DTensor views it)."""
        device = next(a.device for a in args if isinstance(a, Box))
        unwrapped = tree_map(lambda t: t.x if isinstance(t, Box) else t, (args, kwargs or {}))
        out = func(*unwrapped[0], **unwrapped[1])
        return tree_map(lambda t: cls(t, device) if isinstance(t, torch.Tensor) else t, out)


class Everywhere(nn.Module):
    """Wrappers nested five deep, held by a partial, and in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        t = torch.randn(4)
        for _ in range(5):
            t = Box(t)
        self.register_buffer("deep", t)
        self.fn = functools.partial(torch.add, Box(torch.randn(4)))
        self.register_buffer("plain", torch.randn(2))


def _innermost(t: torch.Tensor) -> torch.Tensor:
    while isinstance(t, Box):
        t = t.x
    return t


def test_wrappers_at_any_depth_and_in_any_slot() -> None:
    torch.manual_seed(0)
    eager = Everywhere()
    torch.manual_seed(0)
    m = fxinit.trace_init(Everywhere)
    fxinit.materialize_module(m, buffers_only=True)
    assert not fxinit.is_deferred(_innermost(m.deep)) and fxinit.is_deferred(m)  # the partial's is left
    fxinit.materialize(m, device="cpu:0")  # the CPU, by another name: nothing moves
    assert not fxinit.is_deferred(m)
    assert torch.equal(_innermost(m.deep), _innermost(eager.deep))
    assert torch.equal(m.fn.args[0].x, eager.fn.args[0].x)


@pytest.mark.parametrize("how", ["materialize_module", "tensor", "init=False"])
def test_a_wrapper_built_on_meta_is_refused_on_every_path(how) -> None:
    m = fxinit.trace_init(AsksWithoutTorchFunction)
    with pytest.raises(DeferredInitError, match="says it is on 'meta'"):
        if how == "materialize_module":
            fxinit.materialize_module(m)
        elif how == "tensor":
            fxinit.materialize(m.weight)
        else:
            fxinit.materialize(m, init=False)


def test_a_dtensor_whose_local_tensor_is_a_wrapper(tmp_path) -> None:
    """FSDP2 over torchtune's QLoRA weights: a DTensor whose local tensor is an ``NF4Tensor``
    around deferred tensors (found by a review: left deferred while is_deferred said False)."""
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate

        mesh = init_device_mesh("cpu", (1,))

        class Sharded(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                local = Box(torch.randn(8, 4))
                self.weight = nn.Parameter(DTensor.from_local(local, mesh, [Replicate()], run_check=False),
                                           requires_grad=False)

        torch.manual_seed(0)
        eager = Sharded()
        torch.manual_seed(0)
        m = fxinit.trace_init(Sharded)
        assert fxinit.is_deferred(m)
        fxinit.materialize(m)
        assert not fxinit.is_deferred(m)
        got, want = m.weight._local_tensor, eager.weight._local_tensor
        assert type(got) is type(want) is Box and torch.equal(_innermost(got), _innermost(want))
    finally:
        dist.destroy_process_group()


class Strict(torch.Tensor):
    """A wrapper of other code, as quanto's ``ActivationQBytesTensor``: ``copy_`` only between
    two of its kind (quanto asserts their ``qtype``), any other op on the tensor it holds."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> "Strict":
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor) -> None:
        self.data_, self.qtype = data, "int8"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["data_"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: None, size: torch.Size, stride: tuple) -> "Strict":
        return Strict(inner["data_"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.copy_.default:
            assert args[0].qtype == args[1].qtype
        inner = tree_map(lambda t: t.data_ if isinstance(t, Strict) else t, (args, kwargs or {}))
        return func(*inner[0], **inner[1])


class _MixesAWrapper(nn.Module):
    def __init__(self, given: Strict) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(4)
        nn.init.normal_(self.ln.weight)
        self.register_buffer("mixed", torch.nn.functional.layer_norm(given, (4,), self.ln.weight, self.ln.bias))
        self.register_buffer("summed", given + self.ln.weight)
        self.register_buffer("scaled", torch.mul(self.ln.bias + 1, given))  # (its __torch_function__ second)


def test_a_wrapper_of_other_code_mixed_with_deferred_tensors_runs_its_own_dispatch() -> None:
    """Found by a sweep of optimum-quanto: a wrapper subclass among deferred arguments was
    taken for a real tensor and copied into the graph as a constant, a copy its own
    ``__torch_dispatch__`` ran: quanto's ``copy_`` raised an AttributeError (calibrating a
    model inside ``fxinit.recording``), or a "plain meta tensor" refusal named the wrong
    cause. Its own ``__torch_dispatch__`` takes the call now, as in eager, and calls again
    with the tensors it holds: real ones or deferred ones."""
    given = Strict(torch.randn(2, 4))
    torch.manual_seed(0)
    eager = _MixesAWrapper(given)
    torch.manual_seed(0)
    traced = fxinit.materialize(fxinit.trace_init(_MixesAWrapper, given))
    for name in ("mixed", "summed", "scaled", "ln.weight"):
        assert compare_tensors(name, traced.get_buffer(name) if "." not in name else traced.ln.weight,
                               eager.get_buffer(name) if "." not in name else eager.ln.weight) is None, name

    torch.manual_seed(0)
    with torch.no_grad():  # (a calibration's forward)
        eager_out = eager.ln(Strict(eager.ln.weight * 2))
    torch.manual_seed(0)
    m = fxinit.trace_init(_MixesAWrapper, given)
    with fxinit.recording(m), torch.no_grad():
        wrapper = Strict(m.ln.weight * 2)  # around a deferred tensor
        m.register_buffer("out", m.ln(wrapper))
    fxinit.materialize(m)
    assert compare_tensors("out", m.out, eager_out) is None


class Unwraps(torch.Tensor):
    """A wrapper of other code without ``__tensor_flatten__``: any op on the tensor it holds, the
    result as it comes (or wrapped again: ``Rewraps``)."""

    rewrap = False

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "Unwraps":
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        inner = tree_map(lambda t: t.elem if isinstance(t, Unwraps) else t, (args, kwargs or {}))
        out = func(*inner[0], **inner[1])
        return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out) if cls.rewrap else out


class Rewraps(Unwraps):
    rewrap = True


class Sub(torch.Tensor):
    pass


class Declines(torch.Tensor):
    """A ``__torch_function__`` subclass that declines any other class."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(not issubclass(t, Declines) for t in types):
            return NotImplemented
        return super().__torch_function__(func, types, args, kwargs or {})


@torch.jit.script
def _scripted(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, y) + y


class _DeferredFirst(nn.Module):
    """The deferred parameter first among the arguments of ops a wrapper of other code takes."""

    def __init__(self, given: torch.Tensor, wrapped: Rewraps) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 2))
        self.register_buffer("b", torch.rand(2, 2))
        with torch.no_grad():
            wrapped.mul_(self.b)  # the real tensor it holds written with a deferred buffer
        self.register_buffer("held", (self.w * wrapped).elem)  # what the wrapper's dispatch computed
        self.register_buffer("aliased", Unwraps(self.w - given.as_subclass(Sub)).as_subclass(Sub))
        self.register_buffer("scripted", _scripted(Unwraps(self.w), Unwraps(self.w)).detach())
        # inside the wrapper's __torch_dispatch__, a __torch_function__ subclass's own code runs, as in eager
        self.register_buffer("subclassed", (self.w @ Unwraps(given.as_subclass(Declines))).detach())


def test_a_wrapper_of_other_code_takes_ops_where_a_deferred_tensor_comes_first() -> None:
    """Found by a fuzzer: with the deferred tensor first, DeferredTensor's own
    ``__torch_dispatch__`` took the op before the wrapper's (torch asks them in the arguments'
    order): a plain result where eager gives the wrapper's (an AttributeError on ``.elem``), and
    a scripted function on wrappers of deferred tensors refused with "a plain meta tensor".
    ``as_subclass`` of a wrapper whose alias is a deferred tensor crashed in torch. Inside the
    wrapper's ``__torch_dispatch__``, subclasses' ``__torch_function__`` was off (fxinit's
    handler had turned it off): a plain result where eager's is the subclass's, silently."""
    given = torch.randn(2, 2, generator=torch.Generator().manual_seed(9))
    torch.manual_seed(0)
    eager_wrapped = Rewraps(given.clone())
    eager = _DeferredFirst(given, eager_wrapped)
    torch.manual_seed(0)
    wrapped = Rewraps(given.clone())
    traced = fxinit.trace_init(_DeferredFirst, given, wrapped)
    assert torch.equal(wrapped.elem, eager_wrapped.elem)  # (written during the trace, as in eager)
    fxinit.materialize(traced)
    for name in ("w", "b", "held", "aliased", "scripted", "subclassed"):
        got, want = getattr(traced, name), getattr(eager, name)
        assert type(got) is type(want) and compare_tensors(name, got, want) is None, name


class _StaleView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        with torch.no_grad():
            self.register_buffer("flat", self.weight.view(-1))


def test_a_no_grad_view_of_a_parameter_written_afterwards_is_refused_by_name() -> None:
    """Found by a fuzzer (through ``p.mul_(m)`` under ``no_grad`` with ``m`` a tensor subclass,
    which gives ``p.as_subclass``): torch refuses such a view's ``grad_fn`` after its base is
    written in place, in eager too, so any use of it with gradients fails there; materialize
    crashed with torch's message from fxinit's own reads. Refused by name now."""
    eager = _StaleView()
    nn.init.normal_(eager.weight)
    with pytest.raises(RuntimeError, match="view was created in no_grad mode"):
        eager.flat * 2
    m = fxinit.trace_init(_StaleView)
    nn.init.normal_(m.weight)
    with pytest.raises(DeferredInitError, match="made under torch.no_grad .* written in place") as info:
        fxinit.materialize(m)
    assert "self.weight.view(-1)" in str(info.value)
