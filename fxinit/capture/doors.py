"""Python-level doors around the dispatcher, for deferred tensors.

Some Tensor methods never reach ``__torch_dispatch__``: they read or write the data in
C++ or Python directly. On a deferred tensor (a meta tensor underneath) they would do
nothing, silently. Each is closed here, in one of the contract's three ways:

* ``Tensor.new(...)``, the legacy constructor, builds "like" its tensor: it becomes the
  ``new_empty`` / ``new_tensor`` it stands for, recorded (on meta it would make a plain
  meta tensor that materialize never fills);
* ``apply_``, ``map_``, ``map2_`` call Python per element: they run for real on exact
  values when those are cheap to know, and the result is recorded as a copy into the
  tensor; otherwise they are refused;
* ``numpy()`` and ``__array__`` answer, while recording, with a read-only array of the exact
  value, so a write through it raises instead of landing in a copy (raw storage access,
  ``data_ptr`` and DLPack are refused in ``capture.deferred``);
* ``torch.tensor([a, b])`` of deferred one-element tensors: Python would read their values
  (``item()``); the elements are stacked instead, as recorded ops;
* ``nn.Parameter`` subclasses: ``Parameter.__new__`` turns a deferred tensor into a
  deferred tensor flagged as a parameter, which loses the class; from the first trace on
  (during a trace and after it: a layer swap, a deep copy) it notes the class on the tensor,
  and materialize builds the value as that class. So do
  ``as_subclass`` and ``torch.Tensor._make_subclass`` (bitsandbytes' ``Params4bit``), which
  would make a second Python object of the meta tensor (torch refuses: it has one);
* ``numpy()`` after the trace, where no mode would see ``from_numpy`` or ``as_tensor`` of the
  array: a CPU tensor alone on its storage becomes real at once, so the array is its memory
  as in eager; others get the read-only copy, a later write to them is refused, and
  ``torch.from_numpy`` of it (replaced from the first trace on) is an alias of the tensor;
* ``real.data = deferred`` after the trace: torch's setter asks only ``real`` for a
  ``__torch_function__`` and would fail deep in C++; from the first trace on, ``Tensor.data``
  is a property that sends that one case to ``Shadows.set_real_data``.
"""

from __future__ import annotations

import copy
import threading
import warnings
import weakref
from typing import Any, Callable

import numpy as np
import torch
from torch._C import TensorBase
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.capture.deferred import (DATA_PROPERTY, OWN_ATTRIBUTES, PARAMETER_CLASS, dressed_as, eager_device,
                                     is_deferred_tensor, made_as, state_of)
from fxinit.capture.devices import CPU, META, default_device
from fxinit.capture.lifted import LiftedWithGrad
from fxinit.capture.moves import Move, with_index
from fxinit.capture.real import adopt_real, contains_deferred, shares_memory
from fxinit.capture.schema import mutated_arg_indices, updates_running_stats
from fxinit.capture.storages import storage_key
from fxinit.capture.subclass_code import dispatches_itself
from fxinit.capture.torchscript_calls import send_torchscript_calls_here
from fxinit.capture.trees import map_tree
from fxinit.errors import DeferredInitError

aten = torch.ops.aten


class Doors:
    """The Recorder's answers at these doors (a mixin, like ``capture.shadows.Shadows``: it
    uses the recorder's values, ``fail``, ``lift`` and ``dispatch``);
    ``DeferredTensor.__torch_function__`` sends the calls here."""

    def with_real_arguments_lifted(self, func: Any, args: tuple, kwargs: dict,
                                   run: Callable[[Any, tuple, dict], Any]) -> Any:
        """``run(func, args, kwargs)`` with the real tensors among them lifted as graph constants:
        composite functions check devices before the dispatcher would lift them
        (``torch._weight_norm`` of a loaded ``weight_g`` and a deferred ``weight_v``). Not for
        the arguments a function writes (an in-place method's first, ``out=``): a lifted copy
        would take the write. Others may write too (``F.batch_norm``'s running statistics): that
        is refused. One that requires grad keeps its autograd edge (``capture.lifted``); so does
        one an in-place method reads (``y.add_(x)``), the others left to the dispatcher."""
        name = getattr(func, "__name__", "_")
        if "out" in kwargs or name == "set_":
            return run(func, args, kwargs)
        copies: set[int] = set()
        dunder = name.startswith("__")
        if isinstance(func, torch._ops.OpOverload):  # ``aten.mul_.Tensor`` (a wrapper's __torch_dispatch__ calls them)
            in_place = 0 in mutated_arg_indices(func)
        else:
            in_place = name.endswith("_") and (not dunder or name.startswith("__i") or name == "__setitem__")

        def lift(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not is_deferred_tensor(x) and x.device.type != "meta" \
                    and not dispatches_itself(type(x)):  # (its own __torch_dispatch__ takes it: capture.modes)
                with_grad = x.requires_grad and torch.is_grad_enabled()
                if in_place and not with_grad:
                    return x
                lifted = LiftedWithGrad.apply(x, self) if with_grad else self.lift(x)
                copies.add(self.storage_id(lifted))
                return lifted
            return x

        if in_place:  # it writes its first argument
            args, kwargs = args[:1] + tuple(lift(a) for a in args[1:]), {k: lift(v) for k, v in kwargs.items()}
            if not copies:
                return run(func, args, kwargs)
        else:
            args, kwargs = tuple(lift(a) for a in args), {k: lift(v) for k, v in kwargs.items()}
        last = next(iter(reversed(self.graph.nodes)))
        out = run(func, args, kwargs)
        node = last.next
        while node.op != "root":
            if copies.intersection(node.meta.get("mutates", ())) and \
                    updates_running_stats(node.target, node.args, node.kwargs):
                raise self.fail(
                    f"{getattr(func, '__name__', func)} wrote into a real tensor it was given "
                    "with deferred ones (eager's op writes it in place): the write went to fxinit's copy of it",
                    op=str(node.target), hint="build the tensor written inside the constructor, where it is deferred "
                                              "too, or run this after fxinit.materialize")
            node = node.next
        return out

    def read_only_values(self, func: Any, t: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """``tolist``, ``numpy``, ``__array__``: exact values; arrays read-only (a write would
        change a copy, not the tensor)."""
        if func is not TensorBase.tolist and not self.capturing and self.make_real(t):
            with torch._C.DisableTorchFunctionSubclass():
                return func(t, *args, **kwargs)  # eager's array: the tensor's own memory
        out = self.read_values(func, t, args, kwargs)
        if not isinstance(out, np.ndarray):
            return out
        out = _with_strides(out, t.stride()).view(ReadOnlyValues)  # the shadow's memory stays fxinit's
        out.flags.writeable = False
        out.recorder = self
        # torch.from_numpy(out) is seen by the capture mode, or after the trace by fxinit's
        # torch.from_numpy: both answer with numpy_source
        self.numpy_arrays.append((weakref.ref(out), t))
        if not self.capturing:  # torch.as_tensor(out) is seen by nothing, and eager's would alias t
            _NUMPY_RECORDERS.add(self)
            self.numpy_out.add(self.storage_id(t))
        return out

    def copied_out_by(self, sids: tuple[int, ...]) -> str | None:
        """How a storage among ``sids`` had its value copied out where eager shares it
        (``copied_out``; or an array ``numpy()`` gave after the trace, while it, or a tensor
        ``torch.as_tensor`` made of it, lives: once none does, a write reaches nothing), or None."""
        how = next((self.copied_out[sid] for sid in sids if sid in self.copied_out), None)
        if how is None and self.numpy_out.intersection(sids):
            self.numpy_arrays = [(ref, t) for ref, t in self.numpy_arrays if ref() is not None]
            if any(self.storage_id(t) in sids for _, t in self.numpy_arrays):
                how = "its values were read through numpy() after the trace (a tensor made from that array shares them)"
        return how

    def make_real(self, t: torch.Tensor) -> bool:
        """After the trace, ``numpy()`` of a deferred CPU tensor that owns its storage makes it
        real now (exact value, the same object: ``capture.real.adopt_real``), so the array is
        its memory, as eager's is, whatever is made of it (``from_numpy``, ``as_tensor``) and
        whoever writes. False for views and tensors other tensors refer to."""
        with torch._C.DisableTorchFunctionSubclass():  # the meta tensor underneath
            storage = TensorBase.untyped_storage(t)
            # no other tensor on its storage: its own reference, and the trace's keepalive
            alone = torch._C._storage_Use_Count(storage._cdata) <= 1 + (storage_key(t) in self.storages.by_key)
            own = alone and not t._is_view() and t.storage_offset() == 0
            nbytes = storage.nbytes()
        del storage
        if state_of(t).device.type != "cpu" or not own:
            return False
        value = self.value_of(t, bounded=False)
        if value is None or value.stride() != t.stride() or value.untyped_storage().nbytes() != nbytes:
            return False
        return adopt_real(self, t, value, refuse=False)

    def legacy_new(self, t: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """``t.new(*sizes)``, ``t.new(sequence)``, ``t.new()``, ``t.new(size=..., device=...)``."""
        device = kwargs.get("device")
        options = {"device": torch.device(device) if device is not None else state_of(t).device}
        if not args and "size" not in kwargs:
            args = (0,)  # ``t.new()``: an empty tensor of one dimension, as eager's
        elif len(args) == 1 and isinstance(args[0], torch.Size):
            args = tuple(args[0])
        if all(isinstance(a, int) for a in args) and set(kwargs) <= {"device", "size"}:
            size = tuple(kwargs["size"]) if "size" in kwargs else args
            with torch._C.DisableTorchFunctionSubclass():
                return TensorBase.new_empty(t, size, **options)
        if len(args) == 1 and isinstance(args[0], (list, tuple)) and not kwargs.keys() - {"device"}:
            return self.new_tensor(t, args[0], **options)
        raise self.fail(
            "fxinit does not defer this form of the legacy Tensor.new (a tensor or storage argument)",
            op="Tensor.new",
            hint="use t.new_empty(size), t.new_tensor(data) or torch.as_tensor(x, dtype=t.dtype, device=t.device)")

    def python_elementwise(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """``t.apply_(fn)``, ``t.map_(other, fn)``, ``t.map2_(x, y, fn)`` on a deferred ``t``."""
        t = args[0]
        name = f"Tensor.{func.__name__}"

        def value(x: Any) -> Any:
            if not is_deferred_tensor(x):
                return x
            v = self.value_of(x)
            if v is None:
                raise self.fail(
                    f"fxinit cannot run {name} on a deferred tensor too large to compute while recording: it calls "
                    "Python on each element of the data",
                    op=name, hint="use tensor operations (they are recorded), or call it after fxinit.materialize")
            return v

        real = [value(a) for a in args]
        with self.suspended(), torch.no_grad():
            result = real[0].clone()
            func(result, *real[1:], **kwargs)
            with torch._C.DisableTorchFunctionSubclass():
                self.dispatch(aten.copy_.default, (t, self.lift(result, copy=False)), {})
        return t

    def numpy_source(self, real: torch.Tensor) -> torch.Tensor:
        """``torch.from_numpy(a)`` (seen as a real tensor on ``a``'s memory): itself, or, where
        ``a`` is (part of) the array ``numpy()`` gave for a deferred tensor — eager's tensor is
        then that tensor's memory — an alias of that tensor when ``a`` is all of it; a part is
        refused."""
        if not self.numpy_arrays:
            return real
        ptr = real.data_ptr()
        self.numpy_arrays = [(ref, t) for ref, t in self.numpy_arrays if ref() is not None]
        for ref, t in self.numpy_arrays:
            array = ref()
            if array is None:
                continue
            start = array.ctypes.data
            if start <= ptr < start + max(array.nbytes, 1):
                whole = ptr == start and tuple(real.shape) == array.shape and real.dtype == t.dtype \
                    and tuple(real.stride()) == tuple(t.stride())
                if not whole:
                    raise self.fail(
                        "fxinit cannot make a tensor of part of the array numpy() gave for a deferred tensor: "
                        "eager's would share that tensor's memory", op="torch.from_numpy",
                        hint="index the tensor itself (views are recorded), or copy the array first (np.array(a))")
                if t.storage_offset():
                    raise self.fail(
                        "fxinit cannot make a tensor of the array numpy() gave for a deferred view that starts inside "
                        "its storage (x[1:]): eager's shares the view's memory in a storage that starts at its first "
                        "element, which an alias of the view cannot be", op="torch.from_numpy",
                        hint="copy the array first (np.array(a)), or use the tensor itself (t.clone() for a copy)")
                return self.data_alias(t)
        return real

    def constant_from(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """``torch.tensor(data)``, ``from_numpy`` & co. during capture."""
        kwargs = dict(kwargs)
        device = kwargs.pop("device", None)
        if device is not None:
            device = with_index(torch.device(device))  # "cuda": the current one, as eager's tensor says
        requires_grad = kwargs.pop("requires_grad", False)
        data = args[0] if args else kwargs.get("data")
        if is_deferred_tensor(data):
            out = self.moved(Move(data, device, kwargs.get("dtype"), False, func is torch.tensor, None))
            return out.detach().requires_grad_(requires_grad) if func is torch.tensor else out
        if shares_memory(func, data, device):
            with self.suspended():  # eager's tensor shares the caller's memory: so does this one
                real = self.numpy_source(func(*args, **kwargs))  # or the deferred tensor numpy() was of
            return real.requires_grad_(True) if requires_grad else real
        if contains_deferred(data):
            return self.tensor_of_deferred(func, data, kwargs.get("dtype"), device, requires_grad)
        if device is None:
            device = default_device() if func not in (torch.from_numpy, torch.frombuffer) else CPU
        with self.suspended():
            real = func(*args, **kwargs) if func in (torch.from_numpy, torch.frombuffer) \
                else func(*args, device="cpu", **kwargs)
        t = self.lift(real, torch.device(device))
        return t.requires_grad_(True) if requires_grad else t

    def new_tensor(self, self_t: torch.Tensor, data: Any, dtype: torch.dtype | None = None,
                   device: Any = None, requires_grad: bool = False) -> torch.Tensor:
        """``t.new_tensor(data)``, ``t`` deferred or real: ``torch.tensor(data)`` with ``t``'s dtype
        and device unless given (tensor data too takes ``t``'s dtype, as in eager)."""
        if device is None:
            device = eager_device(self_t)
        return self.constant_from(torch.tensor, (data,), {"dtype": dtype or self_t.dtype, "device": device,
                                                          "requires_grad": requires_grad})

    def deep_copy(self, t: torch.Tensor, memo: dict) -> torch.Tensor:
        """``copy.deepcopy(t)`` of a deferred leaf, as eager copies: a Parameter, a clone
        (``Parameter.__deepcopy__``: no attributes, hooks or gradient); a plain tensor, set on a
        copy of its whole storage, made once per ``deepcopy`` call, with its own dtype, offset and
        strides (``Tensor.__deepcopy__``: so are the other tensors on it), its attributes and
        gradient deep-copied. A meta tensor's is a clone too."""
        parameter = isinstance(t, torch.nn.Parameter)
        with torch.no_grad():
            if parameter or state_of(t).device.type == "meta":
                value = t.clone(memory_format=torch.preserve_format)
            else:
                copied = memo.setdefault(_DEEPCOPIED_STORAGES, {})
                sid = id(self), self.storage_id(t)
                if sid not in copied:
                    copied[sid] = _storage_copied(self, t)
                value = _bytes_as(self, copied[sid], t)
                if t.is_conj():  # eager sets the copy on the storage, then resolves these views' bits
                    value = value.conj_physical()
                if t.is_neg():
                    value = value.neg()
            new = dressed_as(t, value, carry=False)
            if not parameter:
                new.__dict__.update(copy.deepcopy({k: v for k, v in t.__dict__.items() if k not in OWN_ATTRIBUTES},
                                                  memo))
                if t.grad is not None:
                    new.grad = copy.deepcopy(t.grad, memo)
        memo[id(t)] = new
        return new

    def moved(self, move: Move) -> torch.Tensor:
        """The tensor ``move`` asks for (``t.to("cuda")``, ``t.cuda()``, ``t.to(other)``; a deferred
        or real ``t``), from a capture mode or from capture's own code. Where eager answers with
        ``t`` itself, ``t``; else a copy: onto a device other than the CPU built on meta with
        that device noted as intended, so that the device is never touched (it may be absent),
        and recorded (a real ``t`` as a graph constant); onto the CPU, with its device spelled
        out (torch would read a deferred ``other``'s meta underneath)."""
        t = move.tensor
        if move.keeps(eager_device(t), t.dtype, t):
            return t
        if move.device is not None and move.device.type == "meta" and is_deferred_tensor(t):
            # asked for: not "like the input", which a meta device otherwise means for a deferred one
            with self.intended_device(META), torch._C.DisableTorchFunctionSubclass():  # (not this move again)
                return t.to(**move.to_kwargs(META, copy=True))
        if move.device is None or move.device.type in ("cpu", "meta"):
            return t.to(**move.to_kwargs(move.device or eager_device(t), copy=True))
        if not is_deferred_tensor(t):  # (after the trace too, where no mode would see ``t.to(meta)``)
            here = t.to(dtype=move.dtype, memory_format=move.memory_format or torch.preserve_format)
            return self.lift(here, device=with_index(move.device))
        with self.intended_device(with_index(move.device)):
            return t.to(**move.to_kwargs(META, copy=True))

    def tensor_of_deferred(self, func: Callable, data: Any, dtype: torch.dtype | None, device: Any,
                           requires_grad: bool) -> torch.Tensor:
        """``torch.tensor([a, b])`` of (nested lists of) numbers and one-element deferred
        tensors: the elements stacked, as recorded ops. Dtype and shape are what torch gives
        for real tensors of the same dtypes and shapes (it raises where eager would)."""
        with self.suspended():
            probe = func(map_tree(lambda x: FACTORIES.zeros(x.shape, dtype=x.dtype) if is_deferred_tensor(x) else x,
                                  data), dtype=dtype)

        def build(x: Any) -> torch.Tensor:
            if isinstance(x, (list, tuple)):
                return torch.stack([build(y) for y in x]) if len(x) else FACTORIES.empty(0, dtype=probe.dtype)
            if is_deferred_tensor(x):
                return x.detach().reshape(()).to(probe.dtype)
            return FACTORIES.tensor(x, dtype=probe.dtype)

        out = build(list(data) if isinstance(data, tuple) else data).reshape(probe.shape)
        if out._is_view():  # (eager's is a tensor of its own: materialize makes kept views views again)
            out = out.clone()
        if device is not None:
            out = self.moved(Move(out, torch.device(device), None, False, False, None))
        return out.requires_grad_(True) if requires_grad else out


def _with_strides(values: np.ndarray, stride: tuple[int, ...]) -> np.ndarray:
    """A copy of ``values`` laid out with the tensor strides ``stride`` (in elements), as
    eager's ``numpy()`` lays out its array (strides of size-one dimensions included: a
    tensor made from the array keeps them)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(values.shape, stride)) if values.size else 0
    out = np.lib.stride_tricks.as_strided(np.empty(extent, dtype=values.dtype), values.shape,
                                          tuple(st * values.itemsize for st in stride))
    out[...] = values
    return out


class ReadOnlyValues(np.ndarray):
    """The array ``numpy()`` gives for a deferred tensor: its values, read-only. Eager's
    array shares the tensor's memory; a write into this one could not reach the tensor,
    so it raises (``DeferredInitError`` for item assignment, numpy's read-only error for
    ufuncs with ``out=``)."""

    recorder: Any = None

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.recorder is None:  # an array derived from one (a view's view, a copy's base)
            return super().__setitem__(key, value)
        raise self.recorder.fail(
            "fxinit cannot write into a deferred tensor through numpy: the array numpy() returns holds a copy of "
            "its values, not its memory",
            op="Tensor.numpy",
            hint="write with tensor operations under torch.no_grad() (they are recorded), or after fxinit.materialize")


_PARAMETER_NEW = torch.nn.Parameter.__new__
_patch_lock = threading.Lock()


def _parameter_new(cls: type, data: Any = None, requires_grad: bool = True) -> Any:
    try:
        t = _PARAMETER_NEW(cls, data, requires_grad)
    except RuntimeError as exc:
        if 'on device "meta"' in str(exc) and _wraps_deferred(data):
            raise _wrapper_on_meta(cls, data) from exc
        raise
    if cls is not torch.nn.Parameter and is_deferred_tensor(t):
        made_as(t, cls)
    elif is_deferred_tensor(data) and PARAMETER_CLASS in data.__dict__:  # a parameter of a tensor subclass's
        made_as(t, data.__dict__[PARAMETER_CLASS])  # object: eager's is of that class
    return t


def _wraps_deferred(data: Any) -> bool:
    """``data`` is a wrapper tensor subclass (``__tensor_flatten__``) with a deferred tensor inside."""
    flatten = getattr(type(data), "__tensor_flatten__", None)
    if flatten is None or is_deferred_tensor(data):
        return False
    try:
        names = flatten(data)[0]
    except Exception:  # noqa: BLE001  (the subclass's own error is not this one's: torch's stands)
        return False
    return any(is_deferred_tensor(getattr(data, name, None)) for name in names)


def _wrapper_on_meta(cls: type, data: Any) -> DeferredInitError:
    """``nn.Parameter(w)`` of a wrapper around deferred tensors whose ``detach`` built its result
    on the device a deferred tensor reported with subclasses' ``__torch_function__`` off (meta,
    underneath), then failed to alias it to ``w`` (torch's ``return_and_correct_aliasing``):
    torchao's ``quantize_`` of a traced model. Named, rather than torch's device error."""
    return DeferredInitError(
        f"{cls.__name__}({type(data).__name__}) around deferred tensors: the wrapper's own code built its detached "
        "copy on the device a deferred tensor reported where subclasses' __torch_function__ was off ('meta', "
        "underneath), so eager's device is unknown (torchao's quantize_ before fxinit.materialize does this)",
        op=f"{cls.__name__}.__new__",
        hint="quantize after fxinit.materialize, or build the wrapper with the device of the tensor it wraps as seen "
             "outside __torch_function__ (torchao's NF4Tensor does)")


_MAKE_SUBCLASS = torch.Tensor._make_subclass
_AS_SUBCLASS = torch.Tensor.as_subclass


def _make_subclass(cls: type[Any], data: torch.Tensor, requires_grad: bool = False, **kwargs: Any) -> Any:
    """``torch.Tensor._make_subclass`` (bitsandbytes' ``Params4bit``): of a deferred tensor,
    torch would make a second Python object of its meta tensor, which has one (an error). A
    deferred tensor that says it is ``cls`` instead, materialized as one (``dressed_as``).
    (The signature of torch.compile's stand-in for it, which its import, if a constructor
    triggers it, checks against whatever ``torch.Tensor._make_subclass`` is then.)"""
    if not is_deferred_tensor(data):
        return _MAKE_SUBCLASS(cls, data, requires_grad, **kwargs)
    t = data.detach().requires_grad_(requires_grad)
    made_as(t, cls)
    if issubclass(cls, torch.nn.Parameter):
        t._is_param = True
    return t


def _as_subclass(self: torch.Tensor, cls: type) -> Any:
    """``Tensor.as_subclass`` (no ``__torch_function__`` sees it): of a deferred tensor, a
    recorded alias made as ``cls``, attached to autograd as eager's is. Of a wrapper of other
    code, its alias, which its ``__torch_dispatch__`` may give as the deferred tensor it holds
    (torch would make a second Python object of that one's meta tensor: an error)."""
    deferred = is_deferred_tensor(self)
    if not deferred and not dispatches_itself(type(self)):
        return _AS_SUBCLASS(self, cls)
    with torch._C.DisableTorchFunctionSubclass():  # (eager's as_subclass shows no op to a __torch_function__)
        out = torch.ops.aten.alias.default(self)
    if not deferred and not is_deferred_tensor(out):
        return _AS_SUBCLASS(out, cls)  # (an alias of the alias: the same view, as eager's)
    made_as(out, cls)
    return out


_TO_DLPACK = torch._C._to_dlpack


def _to_dlpack(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.dlpack.to_dlpack`` (DGL hands every index tensor to C++ so), which no
    ``__torch_function__`` sees: of a deferred tensor, refused by name as ``__dlpack__`` is
    (torch would raise "Cannot pack tensors on meta")."""
    if is_deferred_tensor(tensor):
        state_of(tensor).recorder.fail_raw_access(_TO_DLPACK)
    return _TO_DLPACK(tensor, *args, **kwargs)


_PARAMETER_META = type(torch.nn.Parameter)
_PARAMETER_CALL = _PARAMETER_META.__call__


def _parameter_call(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``MyParameter(...)`` (``nn.Parameter``'s metaclass): Python runs the ``__init__`` of the
    object's own type where that type is ``MyParameter`` or a subclass of it, which a deferred
    tensor's type (fxinit's) is not; run the ``__init__`` of the class it was made as here, as
    eager's call does (fairscale's ``FlatParameter`` keeps its parameters' shapes there)."""
    obj = _PARAMETER_CALL(cls, *args, **kwargs)
    made = obj.__dict__.get(PARAMETER_CLASS) if is_deferred_tensor(obj) else None
    if made is not None and issubclass(made, cls) and made.__init__ is not torch.nn.Parameter.__init__:
        made.__init__(obj, *args, **kwargs)
    return obj


_PATCHES = ((torch.nn.Parameter, "__new__", _PARAMETER_NEW, _parameter_new),
            (_PARAMETER_META, "__call__", _PARAMETER_CALL, _parameter_call),
            (torch.Tensor, "_make_subclass", _MAKE_SUBCLASS, staticmethod(_make_subclass)),
            (torch.Tensor, "as_subclass", _AS_SUBCLASS, _as_subclass),
            (torch.utils.dlpack, "to_dlpack", _TO_DLPACK, _to_dlpack),
            (torch, "to_dlpack", _TO_DLPACK, _to_dlpack))


_FROM_NUMPY = torch.from_numpy
_NUMPY_RECORDERS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # recorders that gave arrays after a trace
_installed = False


def _from_numpy(array: Any) -> torch.Tensor:
    """``torch.from_numpy``, answering for the arrays ``numpy()`` gave after a trace as the
    capture mode answers during one (``Doors.numpy_source``)."""
    if isinstance(array, ReadOnlyValues):  # fxinit's copy of a deferred tensor's value: eager's array is writable
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            out = _FROM_NUMPY(array)
    else:
        out = _FROM_NUMPY(array)
    if _NUMPY_RECORDERS and out.numel():
        for rec in list(_NUMPY_RECORDERS):
            alias = rec.numpy_source(out)
            if alias is not out:
                return alias
    return out


_from_numpy.__doc__ = _FROM_NUMPY.__doc__


def open_doors_after_trace() -> None:
    """From the first recorder on, ``real.data = deferred``, ``torch.from_numpy`` of fxinit's
    arrays, the classes tensors are made as (``nn.Parameter`` subclasses, ``_make_subclass``,
    ``as_subclass`` of a deferred tensor: bitsandbytes' ``Params4bit(w.data)`` in a layer swap,
    ``copy.deepcopy`` of a model holding one) and TorchScript calls reach fxinit, during a
    trace and after it (see the module docstring, and ``capture.torchscript_calls``). Once,
    for the process: the same objects stay in place, so that code torch.compile'd against
    them is not recompiled each time a recorder comes or goes."""
    global _installed
    with _patch_lock:
        if not _installed:
            torch.Tensor.data = DATA_PROPERTY  # type: ignore[assignment]
            torch.from_numpy = _from_numpy  # type: ignore[assignment]
            for owner, name, _, patch in _PATCHES:
                setattr(owner, name, patch)
            send_torchscript_calls_here()
            _installed = True


_DEEPCOPIED_STORAGES = "fxinit: storages deep-copied"  # a key of copy.deepcopy's memo


def _storage_copied(rec: Any, t: torch.Tensor) -> torch.Tensor:
    """A copy of all of ``t``'s storage, as bytes (``copy.deepcopy``: tensors of other dtypes
    may share it)."""
    with torch._C.DisableTorchFunctionSubclass():  # the meta storage underneath
        nbytes = TensorBase.untyped_storage(t).nbytes()
    n, rest = divmod(nbytes, t.element_size())
    if rest:
        raise _not_whole_elements(rec, t, nbytes)
    if t.is_conj():  # the bits in memory, not the values these views show
        t = t.conj()
    if t.is_neg():
        t = torch._neg_view(t)
    if t.storage_offset() == 0 and t.numel() == n and t.is_contiguous():
        whole = t.clone(memory_format=torch.contiguous_format)  # the common case: the tensor is its storage
    else:
        whole = t.as_strided((n,), (1,), 0).clone()
    return whole.reshape(-1).view(torch.uint8)


def _bytes_as(rec: Any, copied: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``'s view (dtype, offset, strides) of the storage ``copied`` holds, as bytes."""
    if copied.numel() % t.element_size():
        raise _not_whole_elements(rec, t, copied.numel())
    return copied.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())


def _not_whole_elements(rec: Any, t: torch.Tensor, nbytes: int) -> Exception:
    return rec.fail(f"copy.deepcopy of a {t.dtype} tensor on a storage of {nbytes} bytes, not a whole number of its "
                    "elements: fxinit copies a storage through the tensors on it", op="copy.deepcopy",
                    hint="deepcopy the module before the storage is viewed as another dtype, or after "
                         "fxinit.materialize")
