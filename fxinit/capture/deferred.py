"""DeferredTensor: a tensor with shape, dtype and intended device but no data.

It is a meta tensor underneath (so every shape computation is PyTorch's own), with a
``__torch_dispatch__`` that records each aten op into its recorder's graph and a
``__torch_function__`` that keeps Python-level behaviour faithful:

* during capture it reports its intended device (``cpu``, ``cuda:0``) and
  ``is_meta == False``, so model code takes the same branches as in eager construction;
  afterwards it reports ``device='meta'``;
* ``.data`` reads and writes, ``.to()``/``.cpu()`` no-ops and ``new_tensor`` behave as on
  a real tensor;
* reading values (``.item()``, ``.tolist()``, ``numpy()``, ``bool(t)``) is answered
  from a small exact shadow when one exists, and otherwise raises DeferredInitError;
  raw storage access always raises.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import types
import weakref
from typing import Any

import numpy as np
import torch
from torch._C import TensorBase
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.capture.compiled_calls import IS_COMPILING, refuse_compiled_call
from fxinit.capture.grad_branches import run_as_eager
from fxinit.capture.grad_hooks import backward_hooks, note_new_hooks, register_hook_dict
from fxinit.capture.indices import as_index
from fxinit.capture.materialized_marks import mark, trace_serial
from fxinit.capture.moves import PARSE_TO, legacy_type_name, parse_move, shallow_copy_kind, with_index
from fxinit.capture.post_import import run_pending
from fxinit.capture.subclass_code import (NOT_SUBCLASS_CODE, TORCH_FUNCTION_OFF, dispatches_itself,
                                          other_codes_torch_function, run_subclass_code, subclass_attribute,
                                          turned_off_by_fxinit, wrappers_dispatch)
from fxinit.errors import DeferredInitError

_META = torch.device("meta")
_DISTRIBUTED_DIR = os.path.join(os.path.dirname(torch.__file__), "distributed") + os.sep
#: torch.distributed code that loads values into a model (``set_model_state_dict``): it is told
#: the intended device, as eager's tensors would tell it, and copies into the deferred tensors
#: (recorded), where ``meta`` would have it assign new tensors on the process group's device
_LOADERS = frozenset(os.path.join(_DISTRIBUTED_DIR, "checkpoint", name) for name in ("state_dict.py",))
STATE_ATTR = "_fxinit_state"
PARAMETER_CLASS = "_fxinit_parameter_class"  # an nn.Parameter subclass the tensor was made as (capture.doors)
#: recorders whose deferred tensors were made as other classes (``made_as``), while they live -> those classes
CLASSES_MADE_AS: weakref.WeakKeyDictionary[Any, set[type]] = weakref.WeakKeyDictionary()
#: fxinit's own entries of a deferred tensor's ``__dict__`` (``_is_param``: a class attribute of Parameter)
RETAINS_GRAD = "_fxinit_retains_grad"  # ``retain_grad()`` was called on it: the materialized tensor's is too
SHARED = "_fxinit_shared"  # ``share_memory_()`` was called on it: the materialized tensor's memory is shared
OWN_ATTRIBUTES = frozenset((STATE_ATTR, PARAMETER_CLASS, RETAINS_GRAD, SHARED, "_is_param"))

# Getters and methods handled specially, keyed by the descriptor/function object.
_DEVICE = TensorBase.device
_IS_META = TensorBase.is_meta
_RETAINS_GRAD = TensorBase.retains_grad
_IS_CPU = TensorBase.is_cpu
_IS_CUDA = TensorBase.is_cuda
_DATA = TensorBase.data


def _get_data(self: torch.Tensor) -> torch.Tensor:
    return _DATA.__get__(self, type(self))


def _set_data(self: torch.Tensor, value: Any) -> None:
    if is_deferred_tensor(value) and not is_deferred_tensor(self) and type(self) in (torch.Tensor, torch.nn.Parameter):
        state_of(value).recorder.set_real_data(self, value)
    else:  # (``Module._apply``'s ``param.data = converted``: the tensor keeps its mark, as its class and hooks)
        serial = trace_serial(self)
        _DATA.__set__(self, value)
        mark(self, serial)


#: ``Tensor.data`` from the first trace on (``capture.doors.open_doors_after_trace``): torch's
#: setter asks only the tensor written for a ``__torch_function__``, so ``real.data = deferred``
#: after the trace would fail deep in C++.
DATA_PROPERTY = property(_get_data, _set_data, doc=_DATA.__doc__)
_DATA_DESCRIPTORS = (_DATA, DATA_PROPERTY)
_AUTOCAST_ON = torch._C._is_any_autocast_enabled
_SETITEM = torch.Tensor.__setitem__
_GETITEM = torch.Tensor.__getitem__
_FORMAT = torch.Tensor.__format__
_SHALLOW_COPY_COMPATIBLE = torch._has_compatible_shallow_copy_type
_INDEX_SEQUENCES = (list, tuple, range, np.ndarray)
_HOOK_SLOTS = [getattr(TensorBase, name) for name in ("_backward_hooks", "_post_accumulate_grad_hooks")
               if hasattr(TensorBase, name)]
_BACKWARD_HOOKS = TensorBase._backward_hooks
_REGISTER_HOOK = torch.Tensor.register_hook
_RAW_ACCESS = {
    TensorBase.data_ptr,
    TensorBase.untyped_storage,
    torch.Tensor._typed_storage,
    torch.Tensor.storage,
    torch.Tensor.__dlpack__,
    torch.Tensor.__dlpack_device__,  # (asked first, by torch.utils.dlpack and numpy's from_dlpack)
}
_LOAD_FROM_STATE_DICT = torch.nn.Module._load_from_state_dict.__code__
_VALUE_READS = {TensorBase.tolist, TensorBase.numpy, torch.Tensor.__array__}
#: ``tensor_split(x, points)``: eager reads the values of ``points``, a CPU tensor of integers
_TENSOR_SPLITS = (torch.tensor_split, TensorBase.tensor_split)
_SPLIT_POINTS = "tensor_indices_or_sections"  # its keyword
_SHAPED_LIKE = {TensorBase.view_as: TensorBase.view, TensorBase.reshape_as: TensorBase.reshape,
                TensorBase.expand_as: TensorBase.expand}
_PYTHON_ELEMENTWISE = {TensorBase.apply_, TensorBase.map_, TensorBase.map2_}
#: ``{code object: answer(frame, tensor) -> bool | None}``: library functions that ask a
#: deferred tensor ``is_meta`` to decide whether to communicate (``capture.collectives``);
#: None lets the usual answer through.
IS_META_ANSWERS: dict[Any, Any] = {}
#: ``{code object: value}``: what ``data_ptr()`` of a deferred tensor answers to library code
#: that reads it to decide, not to touch memory (``capture.branches``); others are refused.
RAW_ACCESS_ANSWERS: dict[Any, Any] = {}
_OBJECT_CLASS = object.__dict__["__class__"]
_SWAP_TENSORS = frozenset([torch.utils.swap_tensors.__code__, *(  # and its swap_attr
    c for c in torch.utils.swap_tensors.__code__.co_consts if isinstance(c, types.CodeType))])


class DeferredState:
    """What a DeferredTensor knows beyond its meta metadata."""

    __slots__ = ("recorder", "node", "device", "former", "now")

    def __init__(self, recorder: Any, node: Any, device: torch.device) -> None:
        self.recorder = recorder
        self.node = node
        self.device = device
        self.former: tuple[Any, ...] = ()  # the nodes it held before ``.data =`` rebound it
        # the object that is this tensor now, where ``.data = real`` made it real (``capture.real.adopt_real``):
        # this one is what autograd graphs computed from it before still hold
        self.now: torch.Tensor | None = None


def made_as(t: torch.Tensor, cls: type) -> None:
    """``t`` (deferred) was made as ``cls`` (``nn.Parameter`` subclasses, ``_make_subclass``,
    ``as_subclass``): it answers ``__class__`` and is materialized as one."""
    t.__dict__[PARAMETER_CLASS] = cls
    CLASSES_MADE_AS.setdefault(state_of(t).recorder, set()).add(cls)


def _classes_made_as() -> set[type]:
    """The classes deferred tensors of live traces were made as (``made_as``)."""
    if CLASSES_MADE_AS:
        gc.collect()  # (a materialized model's recorder may be waiting for the cycle collector)
    return set().union(*CLASSES_MADE_AS.values())


def state_of(t: torch.Tensor) -> DeferredState:
    return t.__dict__[STATE_ATTR]


#: ``with plain_attributes():`` fxinit's own reads of deferred tensors' plain attributes
#: (``shape``, ``dtype``, ``grad_fn``, ``requires_grad``, ``_is_view()``) skip the subclass's
#: ``__torch_function__``, which answers them as torch does but costs microseconds each.
plain_attributes = torch._C.DisableTorchFunctionSubclass


def is_deferred_tensor(t: object) -> bool:
    return isinstance(t, DeferredTensor) and STATE_ATTR in t.__dict__


def dressed_as(deferred: torch.Tensor, value: torch.Tensor, keep_autograd: bool = False,
               carry: bool = True) -> torch.Tensor:
    """``value`` in the place of ``deferred``: a Parameter (of the subclass it was made as)
    if that was one, its ``requires_grad``, and unless not ``carry``, its gradient hooks and
    the attributes user code set on it (not fxinit's own). ``keep_autograd``: ``value``
    itself, with its ``grad_fn`` (a tensor computed from parameters: ``fxinit.autograd_links``)."""
    cls = deferred.__dict__.get(PARAMETER_CLASS)
    with torch._C.DisableTorchFunctionSubclass():
        requires_grad = deferred.requires_grad
    if deferred.__dict__.get(SHARED) and value.device.type == "cpu":
        value.share_memory_()  # (of its storage, which its views see too, as eager's do)
    if keep_autograd:  # (``deferred`` may be real since its first swap: then its own type is the one made)
        made_as = cls or (type(deferred) if type(deferred) not in (torch.Tensor, DeferredTensor) else None)
        new = value if made_as is None or issubclass(made_as, torch.nn.Parameter) else value.as_subclass(made_as)
        if made_as is not None and issubclass(made_as, torch.nn.Parameter):  # written in place with autograd:
            with contextlib.suppress(TypeError):  # eager's is that Parameter (``as_subclass``: an alias in the graph)
                new.__class__ = made_as
    elif cls is not None:
        new = torch.Tensor._make_subclass(cls, value.detach(), requires_grad)
        if deferred.__dict__.get("_is_param") and not isinstance(new, torch.nn.Parameter):
            new._is_param = True  # ``nn.Parameter`` of a tensor subclass's object, as eager's
    elif isinstance(deferred, torch.nn.Parameter):
        new = torch.nn.Parameter(value, requires_grad=requires_grad)
    else:
        new = value.detach()
        if requires_grad:
            new.requires_grad_(True)
    if carry:
        _carry_over(deferred, new)
    st = deferred.__dict__.get(STATE_ATTR)  # (none: a tensor materialized already, rebuilt by autograd_links)
    mark(new, st.recorder.serial if st is not None else trace_serial(deferred))
    return new


def _carry_over(deferred: torch.Tensor, new: torch.Tensor) -> None:
    """What user code set on ``deferred``, set on ``new``: attributes, gradient hooks, ``retain_grad``."""
    for k, v in deferred.__dict__.items():
        if k not in OWN_ATTRIBUTES and k not in new.__dict__:
            new.__dict__[k] = v
    with torch._C.DisableTorchFunctionSubclass():  # gradient hooks registered on the deferred tensor
        for hooks in _HOOK_SLOTS:
            registered = hooks.__get__(deferred)
            if registered:
                if hooks is _BACKWARD_HOOKS:
                    register_hook_dict(new, registered)
                else:
                    hooks.__set__(new, registered)
    if deferred.__dict__.get(RETAINS_GRAD):  # asked again once its ``grad_fn`` is rebuilt (``autograd_links``)
        new.__dict__[RETAINS_GRAD] = True


class DeferredTensor(torch.Tensor):
    """A tensor whose value is the output of a node of an init graph."""

    @staticmethod
    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True, **state: Any) -> torch.Tensor:
        # Reached through ``type(param)(value, requires_grad=...)``: behave like Parameter. accelerate's
        # ``init_empty_weights`` passes the old parameter's ``__dict__`` too, fxinit's state in it; its
        # ``set_module_tensor_to_device`` passes a checkpoint's real tensor.
        if not isinstance(data, torch.Tensor):
            raise TypeError("DeferredTensor objects are created by fxinit capture only")
        unexpected = sorted(set(state) - OWN_ATTRIBUTES)
        if unexpected:  # as Parameter's own ``__new__`` answers them
            raise TypeError(f"__new__() got an unexpected keyword argument '{unexpected[0]}'")
        if not is_deferred_tensor(data) and (classes := _classes_made_as()):
            raise DeferredInitError(
                "type(p)(value) of a deferred parameter: eager's type(p) is the class p was made as, which fxinit "
                "cannot tell from type(p) alone, and a live trace made deferred tensors of other classes "
                f"({', '.join(sorted(c.__qualname__ for c in classes))}) than nn.Parameter",
                hint="call p.__class__(value, ...) (it answers the class p was made as), or materialize before this")
        return torch.nn.Parameter(data, requires_grad=requires_grad)

    def __repr__(self) -> str:  # never touches data
        st = self.__dict__.get(STATE_ATTR)
        dev = st.device if st is not None else "?"
        kind = "Parameter" if getattr(self, "_is_param", False) else "tensor"
        rg = ", requires_grad=True" if self.requires_grad else ""
        # what ``t.device`` and ``t.is_meta`` say to the caller; "Deferred" and ``fxinit.is_deferred``
        # tell it from a real tensor (it is meta underneath, which only torch.distributed is told)
        return (f"Deferred{kind.capitalize() if kind == 'tensor' else kind}(size={tuple(self.shape)}, "
                f"dtype={self.dtype}, device='{dev}'{rg})")

    __str__ = __repr__

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        # ``isinstance(p, MyParameter)`` of a deferred ``MyParameter(...)`` is True, as in
        # eager: isinstance falls back to ``__class__`` when the type itself does not match.
        # ``type(p)`` stays DeferredTensor, which is what torch's dispatch reads.
        cls = self.__dict__.get(PARAMETER_CLASS)
        if cls is None or sys._getframe(1).f_code in _SWAP_TENSORS:
            return type(self)  # swap_tensors swaps the real types, or the other tensor would lose DeferredTensor
        return cls

    @__class__.setter
    def __class__(self, cls: type) -> None:
        _OBJECT_CLASS.__set__(self, cls)

    def __getattr__(self, name: str) -> Any:  # (only where the type has no such attribute)
        cls = self.__dict__.get(PARAMETER_CLASS)
        if cls is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return subclass_attribute(self, cls, name)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        with plain_attributes():
            leaf = self.grad_fn is None
        if not leaf:  # torch's own refusal, word for word
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment.  If you were attempting to deepcopy a module, this may be "
                               "because of a torch.nn.utils.weight_norm usage, see "
                               "https://github.com/pytorch/pytorch/pull/103001")
        cls = self.__dict__.get(PARAMETER_CLASS)
        if cls is not None and cls.__deepcopy__ is not torch.nn.Parameter.__deepcopy__:
            # its own copy runs on ``type(self)``, which is fxinit's class here, not ``cls``
            raise state_of(self).recorder.fail(
                f"copy.deepcopy of a deferred {cls.__qualname__}: the class defines its own __deepcopy__, which "
                "fxinit cannot run on a deferred tensor", op="copy.deepcopy",
                hint="deep-copy the module after fxinit.materialize, or build the copy instead of copying")
        return state_of(self).recorder.deep_copy(self, memo)

    def __copy__(self) -> torch.Tensor:
        raise state_of(self).recorder.fail(
            "copy.copy of a deferred tensor: eager's is another tensor object on the same storage, which fxinit "
            "cannot make", op="copy.copy", hint="use t.view_as(t) or t.detach() (a view), or t.clone() (a copy)")

    def __reduce_ex__(self, proto: int) -> Any:
        rec = state_of(self).recorder
        try:
            name = f" ({rec.storage_names()[rec.storage_id(self)]})"
        except Exception:  # noqa: BLE001  (its name where the model holds it: for the message only)
            name = ""
        raise rec.fail(f"a deferred tensor{name} cannot be pickled or saved", op="pickle",
                       hint="materialize it first (fxinit.materialize); a module whose __deepcopy__ pickles what it "
                            "holds (e3nn's generated code) is deep-copied after materialize")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        if len(types) > 1 and any(t is not cls and dispatches_itself(t) for t in types):
            # a wrapper of other code takes it, as in eager (capture.modes)
            return wrappers_dispatch(func, args, kwargs or {}) if turned_off_by_fxinit() else NotImplemented
        recorder = _recorder_of(args, kwargs)
        if IS_COMPILING():
            refuse_compiled_call(recorder, func)
        with torch._C.DisableTorchFunctionSubclass():  # as in CaptureDispatchMode
            return recorder.dispatch(func, args, kwargs or {})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = other_codes_torch_function(func, types, args, kwargs or {}, cls) if len(types) > 1 else NOT_SUBCLASS_CODE
        return out if out is not NOT_SUBCLASS_CODE else deferred_torch_function(func, args, kwargs or {})


def subclass_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` run by the own code of the class a deferred argument was made as, as eager
    runs it (``capture.subclass_code``), or ``NOT_SUBCLASS_CODE``."""
    made = {i: a.__dict__[PARAMETER_CLASS] for i, a in enumerate((*args, *kwargs.values()))
            if isinstance(a, DeferredTensor) and PARAMETER_CLASS in a.__dict__}
    made.update((-1 - i, a.__dict__[PARAMETER_CLASS]) for i, a in enumerate(  # in lists: torch.cat([p, q])
        x for v in (*args, *kwargs.values()) if isinstance(v, (list, tuple)) for x in v)
        if isinstance(a, DeferredTensor) and PARAMETER_CLASS in a.__dict__)
    return run_subclass_code(func, args, kwargs, made) if made else NOT_SUBCLASS_CODE


def deferred_torch_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """DeferredTensor's ``__torch_function__``. The capture function mode calls it directly
    when deferred tensors are the only overloaded arguments, which saves torch's trip back
    through the subclass layer."""
    if IS_COMPILING():
        refuse_compiled_call(_recorder_of(args, kwargs), func)
    if CLASSES_MADE_AS and (out := subclass_call(func, args, kwargs)) is not NOT_SUBCLASS_CODE:
        return out
    if (func is _SETITEM or func is _GETITEM) and len(args) > 1 and isinstance(args[1], _INDEX_SEQUENCES):
        args = (args[0], as_index(args[1]), *args[2:])  # not as torch would make them, on meta
    if type(func) is PROPERTY_CALL:
        if func.__name__ in ("__get__", "__set__"):
            handled = _property(func.__name__, func.__self__, args)
            if handled is not _NOT_HANDLED:
                return handled
    elif func in _RAW_ACCESS:
        if func is TensorBase.data_ptr and RAW_ACCESS_ANSWERS:
            f = sys._getframe(1)
            for _ in range(4):  # past the modes' and the subclass's __torch_function__
                if f is None or f.f_code in RAW_ACCESS_ANSWERS:
                    break
                f = f.f_back
            if f is not None and f.f_code in RAW_ACCESS_ANSWERS:
                return RAW_ACCESS_ANSWERS[f.f_code]
        _recorder_of(args, kwargs).fail_raw_access(func)
    elif func in _VALUE_READS:
        if func is not TensorBase.tolist and torch.is_grad_enabled() and args[0].requires_grad \
                and not kwargs.get("force"):  # torch's own refusal, word for word
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return _recorder_of(args, kwargs).read_only_values(func, args[0], args[1:], kwargs)
    elif func is TensorBase.retain_grad and len(args) == 1 and is_deferred_tensor(args[0]):
        # torch's hook would hold the deferred tensor, whose value materialize swaps in: noted, and
        # asked again of the materialized tensor (``dressed_as``)
        with torch._C.DisableTorchFunctionSubclass():
            leaf = args[0].grad_fn is None
        if not leaf:
            args[0].__dict__[RETAINS_GRAD] = True
        elif not args[0].requires_grad:  # torch's own refusal, word for word
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        return None
    elif func is _REGISTER_HOOK and args and is_deferred_tensor(args[0]):
        before, st = backward_hooks(args[0]), state_of(args[0])
        handle = _run(func, args, kwargs)
        note_new_hooks(args[0], before, st.node, st.recorder.recorded_nodes)  # (grad_hooks says why)
        return handle
    elif func is torch.Tensor.share_memory_ and is_deferred_tensor(args[0]):
        args[0].__dict__[SHARED] = True  # its memory is shared once it has some (``dressed_as``)
        return args[0]
    elif func is torch.Tensor.is_shared and is_deferred_tensor(args[0]):
        return bool(args[0].__dict__.get(SHARED)) and state_of(args[0]).device.type == "cpu"
    elif func is TensorBase.new and is_deferred_tensor(args[0]):
        return _recorder_of(args, kwargs).legacy_new(args[0], args[1:], kwargs)
    elif func in _PYTHON_ELEMENTWISE:  # capture.doors
        return _recorder_of(args, kwargs).python_elementwise(func, args, kwargs)
    elif func is _SETITEM and len(args) == 3 and isinstance(args[2], (bool, int, float, complex)) \
            and is_deferred_tensor(args[0]) and not state_of(args[0]).recorder.capturing:
        # After the trace no mode sees torch wrap the number: it would wrap it on meta, valueless.
        rec = state_of(args[0]).recorder
        with rec.suspended():
            number = FACTORIES.tensor(args[2], dtype=args[0].dtype)
        args = (args[0], args[1], rec.lift(number))
    elif func is TensorBase.get_device and is_deferred_tensor(args[0]):  # torch would read meta's: -1
        device = reported_device(args[0])
        return -1 if device.type in ("cpu", "meta") else with_index(device).index
    elif func is _SHALLOW_COPY_COMPATIBLE and len(args) == 2 and not kwargs:
        # asked by ``Module._apply`` (``to_empty``, ``.to``): torch would compare the meta tensors underneath
        return shallow_copy_kind(eager_device(args[0]), args[0].layout) == \
            shallow_copy_kind(eager_device(args[1]), args[1].layout)
    elif func is PARSE_TO:  # ``Module.to(t)``: torch would answer the meta device underneath
        with torch._C.DisableTorchFunctionSubclass():
            device, dtype, non_blocking, memory_format = func(*args, **kwargs)
        t = args[0] if args else kwargs.get("tensor")
        return eager_device(t) if is_deferred_tensor(t) else device, dtype, non_blocking, memory_format
    elif func is TensorBase.type and len(args) == 1 and not kwargs and is_deferred_tensor(args[0]):
        return legacy_type_name(reported_device(args[0]), args[0].dtype)  # torch would name meta's type
    elif func is TensorBase.to or func is TensorBase.cpu or func is TensorBase.cuda:
        result = _maybe_noop_move(func, args, kwargs)
        if result is not None:
            return result
        if not is_deferred_tensor(args[0]) and (move := parse_move(func, args, kwargs, eager_device)) is not None:
            return _recorder_of(args, kwargs).moved(move)  # ``real.to(t)``: torch would read meta
    elif func is _FORMAT and len(args) == 2 and is_deferred_tensor(args[0]) and args[0].__class__ is DeferredTensor \
            and state_of(args[0]).device.type != "meta" and args[0].dim() == 0:
        return args[0].item().__format__(args[1])  # eager formats a plain 0-dim tensor as its number
    elif func in _TENSOR_SPLITS and (split := _split_points(args, kwargs)) is not None:
        # torch checks that the points are on the CPU before it reads them: a deferred tensor
        # says meta there. Eager reads their values, so this does (0-dim: a number of sections).
        points = split.tolist()
        rest = args[1:] if _SPLIT_POINTS in kwargs else args[2:]
        kwargs = {k: v for k, v in kwargs.items() if k != _SPLIT_POINTS}
        return func(args[0], points, *rest, **kwargs)
    elif func is TensorBase.new_tensor:
        return _recorder_of(args, kwargs).new_tensor(args[0], *args[1:], **kwargs)
    elif func in _SHAPED_LIKE and len(args) == 2 and not kwargs and not is_deferred_tensor(args[0]):
        # ``real.view_as(deferred)`` reads only the deferred tensor's size: eager's result is
        # a view of the real tensor (``nn.utils.vector_to_parameters``), and so is this one.
        with torch._C.DisableTorchFunctionSubclass():
            return _SHAPED_LIKE[func](args[0], args[1].size())
    else:
        if not any(type(a) is torch.Tensor or type(a) is torch.nn.Parameter for a in args) and \
                not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return _run_lifted(func, args, kwargs)
        return _recorder_of(args, kwargs).with_real_arguments_lifted(func, args, kwargs, _run_lifted)
    return _run(func, args, kwargs)


def _run_lifted(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` of deferred tensors (real ones lifted), under autocast where it is on."""
    if _AUTOCAST_ON():  # after the trace (during it, the capture mode notes it for the recorder)
        _recorder_of(args, kwargs).autocast = True
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        finally:
            _recorder_of(args, kwargs).autocast = False
    return _run(func, args, kwargs)


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` of deferred tensors, as eager runs it, refusing by name where a kernel reads memory."""
    off, TORCH_FUNCTION_OFF.by_fxinit = TORCH_FUNCTION_OFF.by_fxinit, True
    try:
        with torch._C.DisableTorchFunctionSubclass():  # spectral composites: eager's path (capture.grad_branches)
            return run_as_eager(func, args, kwargs, lambda: func(*args, **kwargs))
    except RuntimeError as exc:
        if not isinstance(exc, DeferredInitError) and _META_VALUE_READ in str(exc) and \
                not _recorder_of(args, kwargs).capturing:
            raise _recorder_of(args, kwargs).fail(  # torch.lobpcg after the trace: helpers like its input, on meta
                f"{_torch_name(func)} after the trace needed a value where torch reads it below fxinit's hooks: of a "
                "tensor a composite built like its input, on the meta storage of a deferred tensor (torch.lobpcg), "
                "or of deferred numbers in torch.tensor([...])",
                op=getattr(func, "__name__", str(func)),
                hint="run this init step inside `with fxinit.recording(model):`, where it is recorded as in the "
                     "constructor") from exc
        packed = _torch_name(func) in _RECURRENT and len(args) > 1 and isinstance(args[1], torch.Tensor) \
            and not args[1].is_floating_point()  # (the overload of a PackedSequence: data, batch_sizes, ...)
        if isinstance(exc, DeferredInitError) or not (META_DATA_ACCESS in str(exc) or (
                packed and _BATCH_SIZES_ON_META in str(exc))):
            raise
        raise _recorder_of(args, kwargs).fail(  # a kernel that reads memory itself, below any op fxinit sees
            f"fxinit cannot defer {_torch_name(func)}{' over a PackedSequence' if packed else ''}: its kernel reads "
            "or writes the tensor's memory directly, which a deferred tensor does not have yet"
            + (" (a padded input is recorded)" if packed else ""),
            op=getattr(func, "__name__", str(func)),
            hint="build this tensor after fxinit.materialize, or guard this code with "
                 "`if not fxinit.is_meta_init():`") from exc
    finally:
        TORCH_FUNCTION_OFF.by_fxinit = off


_RECURRENT = frozenset(("torch.lstm", "torch.gru", "torch.rnn_tanh", "torch.rnn_relu"))
#: torch's message for a kernel that touched the data of a tensor without storage (meta)
META_DATA_ACCESS = "data is not allocated yet"
#: torch's message (2.15) for a PackedSequence whose batch sizes are deferred (meta underneath)
_BATCH_SIZES_ON_META = "batch_sizes tensor should be on CPU, but got meta"
#: torch's message for ``.item()`` of a meta tensor
_META_VALUE_READ = "cannot be called on meta tensors"


def _torch_name(func: Any) -> str:
    """``torch.x`` or ``Tensor.x``, as user code calls ``func``."""
    qualname = getattr(func, "__qualname__", None) or str(func)
    owner, _, name = qualname.rpartition(".")
    return {"_VariableFunctionsClass": f"torch.{name}", "TensorBase": f"Tensor.{name}",
            "Tensor": f"Tensor.{name}"}.get(owner, qualname)


_NOT_HANDLED = object()
#: How property reads and writes reach ``__torch_function__``: ``TensorBase.device.__get__``...
PROPERTY_CALL = type(TensorBase.device.__get__)


def _recorder_of(args: Any, kwargs: Any) -> Any:
    for a in args:
        if is_deferred_tensor(a):
            return state_of(a).recorder
        if isinstance(a, (list, tuple)):
            for b in a:
                if is_deferred_tensor(b):
                    return state_of(b).recorder
    for a in (kwargs or {}).values():
        if is_deferred_tensor(a):
            return state_of(a).recorder
    raise RuntimeError("fxinit internal error: no deferred tensor among the arguments")


def reported_device(t: torch.Tensor, caller: Any = None) -> torch.device:
    """The device a deferred tensor reports to the code in frame ``caller``.

    While its model is recorded: the intended device, so model code takes eager's branches.
    Afterwards, to torch.distributed (FSDP, DTensor, tensor parallelism), whose layout code
    reads ``meta`` as "no storage yet" and then allocates instead of communicating: ``meta``.
    To any other code (a framework's ``init_weights``, a parametrization, the user's, and
    torch.distributed's state-dict loader, ``_LOADERS``): the
    intended device, as eager construction would answer, so that tensors it builds "on the
    parameter's device" are real tensors computed now, exactly, instead of plain meta
    tensors nothing records (docs/design.md, "How a deferred tensor presents itself").
    """
    st = state_of(t)
    if st.recorder.capturing or caller is None or not caller.f_code.co_filename.startswith(_DISTRIBUTED_DIR) \
            or caller.f_code.co_filename in _LOADERS:
        return st.device
    return _META


def _property(kind: str, owner: Any, args: tuple) -> Any:
    t = args[0]
    if not is_deferred_tensor(t):
        if kind == "__set__" and owner in _DATA_DESCRIPTORS and is_deferred_tensor(args[1]):
            state_of(args[1]).recorder.set_real_data(t, args[1])
            return None
        return _NOT_HANDLED
    if kind == "__get__":
        if owner is _RETAINS_GRAD and t.__dict__.get(RETAINS_GRAD):
            return True
        if owner is _DEVICE:
            return reported_device(t, sys._getframe(3))  # past deferred_torch_function and its caller
        caller = sys._getframe(3) if owner is _IS_META or owner is _IS_CPU or owner is _IS_CUDA else None
        if owner is _IS_META:
            rec = state_of(t).recorder
            if rec.try_record_opaque(caller, t):
                return True
            if caller.f_code is _LOAD_FROM_STATE_DICT:
                return False  # load_state_dict into a deferred model is recorded, not a no-op
            run_pending()  # answers for torch.distributed modules imported while fxinit was
            answer = IS_META_ANSWERS.get(caller.f_code)
            if answer is not None:
                answered = answer(caller, t)
                if answered is not None:
                    return answered
            return reported_device(t, caller).type == "meta"
        if owner is _IS_CPU:
            return reported_device(t, caller).type == "cpu"
        if owner is _IS_CUDA:
            return reported_device(t, caller).type == "cuda"
        if owner in _DATA_DESCRIPTORS:
            return state_of(t).recorder.data_alias(t)
    elif kind == "__set__" and owner in _DATA_DESCRIPTORS:
        state_of(t).recorder.set_data(t, args[1])
        return None
    return _NOT_HANDLED


def eager_device(t: torch.Tensor) -> torch.device:
    """Where ``t`` is in eager construction: a deferred tensor's intended device, a real one's own."""
    return state_of(t).device if is_deferred_tensor(t) else t.device


def _split_points(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``tensor_split``'s split points where they are a deferred tensor of int64 (as torch
    requires them: other dtypes are left to torch to refuse)."""
    points = kwargs.get(_SPLIT_POINTS, args[1] if len(args) > 1 else None)
    return points if is_deferred_tensor(points) and points.dtype == torch.int64 else None


def _maybe_noop_move(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``t.to(...)`` that eager would answer with ``t`` itself must do the same here; a move to
    meta (accelerate's ``init_empty_weights``) is a copy there, which torch, seeing meta
    underneath, would answer with ``t``."""
    t = args[0]
    if not is_deferred_tensor(t):
        return None
    move = parse_move(func, args, kwargs, eager_device)
    rec = state_of(t).recorder
    if move is not None and move.device is not None and move.device.type == "meta" \
            and not move.keeps(state_of(t).device, t.dtype, t) and rec._intended is None:  # (not a move of
        return rec.moved(move)                                   # fxinit's, built on meta for another device)
    return t if move is not None and move.keeps(state_of(t).device, t.dtype, t) else None
