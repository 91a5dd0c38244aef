"""DTensors whose local tensor is deferred: init code on them acts on the global tensor.

``parallelize_module``, ``distribute_tensor`` and ``fully_shard`` turn a traced model's
parameters into DTensors whose local tensors are deferred. Deterministic ops on such a
DTensor mean the same on the global tensor and on each shard, and DTensor runs them on the
local tensors, where they are recorded. Random init does not: eager construction on one
process draws the *global* tensor from the stream, and DTensor would draw each shard from
its rank's own generator. A ``DeferredDTensor`` therefore runs random init (``normal_``,
``nn.init.kaiming_uniform_``, ``trunc_normal_``...) on a fresh deferred tensor of the global
shape, and records that its local tensor is this rank's slice of it
(``fxinit.capture.layout``). Materializing then fills only that slice where the stream
allows it, exactly as the single-process run would have it, for any layout.

Every DTensor whose local tensor is deferred becomes a DeferredDTensor when it is created
(``install`` wraps ``DTensor.__init__``): DTensors are made by torch's own code
(``distribute_tensor``, FSDP2, DTensor's op dispatcher), so no other point sees them all.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import weakref
from typing import Any, Callable

import torch
from torch._C import TensorBase

from fxinit.capture.deferred import PROPERTY_CALL, is_deferred_tensor, reported_device, state_of
from fxinit.capture.layout import local_runs, local_shape, take
from fxinit.capture.names import tensor_slots
from fxinit.capture.opaque import find_opaque_call
from fxinit.capture.post_import import when_imported
from fxinit.errors import DeferredInitError
from fxinit.ops import resolve_init_function, torch_own

# Set when torch.distributed.tensor is imported (``install``): fxinit imports it never itself.
DTensor: Any = None
DeferredDTensor: Any = None

aten = torch.ops.aten

# Tensor methods that fill their tensor with random numbers without reading it.
_RANDOM_FILLS = {TensorBase.uniform_, TensorBase.normal_, TensorBase.random_, TensorBase.exponential_,
                 TensorBase.cauchy_, TensorBase.log_normal_, TensorBase.geometric_, TensorBase.bernoulli_}
# torch.nn.init functions that fill from their tensor's values alone (every shard alike).
_ELEMENTWISE_INITS = {torch.nn.init.constant_, torch.nn.init.ones_, torch.nn.init.zeros_}
_RANDOM_INIT_NAMES = ("uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                      "kaiming_normal_", "orthogonal_", "sparse_")
_RANDOM_LIKE = {torch.rand_like, torch.randn_like, torch.randint_like}


def is_deferred_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor) and is_deferred_tensor(t._local_tensor)


def _deferred_dtensor_class(dtensor: type) -> type:
    class DeferredDTensor(dtensor):  # type: ignore[misc,valid-type]
        """A DTensor whose local tensor is deferred (see the module docstring)."""

        __slots__ = ()

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
            return _on_call(func, args, kwargs or {}, sys._getframe(1))

    return DeferredDTensor


_DEVICE_QUESTIONS = {TensorBase.device: None, TensorBase.is_meta: "meta", TensorBase.is_cpu: "cpu",
                     TensorBase.is_cuda: "cuda"}


def install() -> None:
    """Make every DTensor created with a deferred local tensor a DeferredDTensor, from the
    moment torch.distributed.tensor is imported (by the user, or torch.distributed's code)."""
    when_imported("torch.distributed.tensor", _wrap_constructor)


def _wrap_constructor(module: types.ModuleType) -> None:
    global DTensor, DeferredDTensor
    if getattr(module.DTensor.__init__, "_fxinit", False):
        return
    DTensor = module.DTensor
    DeferredDTensor = _deferred_dtensor_class(DTensor)
    original = DTensor.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is DTensor and is_deferred_tensor(self._local_tensor):
            self.__class__ = DeferredDTensor

    __init__._fxinit = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    DTensor.__init__ = __init__


def _on_call(func: Any, args: tuple, kwargs: dict, caller: Any) -> Any:
    if not args and "tensor" in kwargs:  # nn.init functions hand their arguments over as keywords
        kwargs = dict(kwargs)
        args = (kwargs.pop("tensor"),)
    target = args[0] if args else None
    if type(func) is PROPERTY_CALL:
        if func.__name__ == "__get__" and func.__self__ is TensorBase.is_meta and isinstance(target, DeferredDTensor):
            call = find_opaque_call(caller, target)
            if call is not None:  # trunc_normal_ & co. ask is_meta first: run them on the global tensor
                fn = resolve_init_function(call.qualname)
                _on_global(target, lambda g: fn(g, **call.kwargs))
                return True
        if func.__name__ == "__get__" and func.__self__ in _DEVICE_QUESTIONS and isinstance(target, DeferredDTensor):
            # as its local tensor answers (capture.deferred.reported_device): the intended device,
            # meta to torch.distributed (DTensor's own device is set in C++ from the meta local)
            device = reported_device(target._local_tensor, caller)
            return device if func.__self__ is TensorBase.device else _DEVICE_QUESTIONS[func.__self__] == device.type
    elif isinstance(target, DeferredDTensor) and (func in _RANDOM_FILLS or _is_random_init(func)):
        _check_reads_nothing_else(func, args, kwargs)
        _on_global(target, lambda g: func(g, *args[1:], **kwargs))
        return target
    elif isinstance(target, DeferredDTensor) and (renamed := _renamed_init(func, target, caller)) is not None:
        # torch's init function, which hands the stand-in under its name to __torch_function__:
        # transformers' guard_torch_init_functions puts its own normal_ (calling torch's) in torch.nn.init
        fn, kwargs = renamed
        _check_reads_nothing_else(fn, (target,), kwargs)
        _on_global(target, lambda g: fn(g, **kwargs))
        return target
    elif func in _RANDOM_LIKE and isinstance(target, DeferredDTensor):
        return _random_like(func, target, args[1:], kwargs)
    with torch._C.DisableTorchFunctionSubclass():  # DTensor runs it on the local tensors
        return func(*args, **kwargs)


def _is_random_init(func: Any) -> bool:
    """``torch.nn.init`` functions other than the element-wise constant fills."""
    return getattr(func, "__module__", None) == "torch.nn.init" and func not in _ELEMENTWISE_INITS


@functools.lru_cache(maxsize=None)
def _random_init_codes() -> dict[Any, Any]:
    """The code of torch's own random init functions -> the function."""
    own = (torch_own(f"torch.nn.init.{name}") for name in _RANDOM_INIT_NAMES)
    return {fn.__code__: fn for fn in own if fn is not None}


def _renamed_init(func: Any, dt: Any, caller: Any) -> tuple[Any, dict] | None:
    """torch's own random init function running on ``dt`` (its frame on the stack, up from
    ``caller``) with its arguments, where ``func``, a function of the same name, has taken its
    place in ``torch.nn.init`` (torch hands what its name holds now to ``__torch_function__``,
    with torch's keywords); else None."""
    codes, f = _random_init_codes(), caller
    for _ in range(8):
        if f is None:
            return None
        fn = codes.get(f.f_code)
        if fn is not None and f.f_locals.get("tensor") is dt:
            if func is fn or getattr(func, "__name__", None) != fn.__name__:  # (its keywords: torch's)
                return None
            names = list(inspect.signature(fn).parameters)[1:]
            return fn, {k: f.f_locals[k] for k in names if k in f.f_locals}
        f = f.f_back
    return None


def _check_reads_nothing_else(func: Any, args: tuple, kwargs: dict) -> None:
    if any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
        raise _refuse(args[0], f"{getattr(func, '__name__', func)} with tensor arguments",
                      "its values would depend on how the tensor arguments are laid out; call it on the global "
                      "tensor before parallelizing, or materialize first")


def _on_global(dt: Any, init: Callable[[torch.Tensor], Any]) -> None:
    """Run ``init`` on a fresh deferred tensor of ``dt``'s global shape, then record that
    ``dt``'s local tensor is this rank's slice of it."""
    local = dt._local_tensor
    rec = state_of(local).recorder
    full = rec.dispatch(aten.empty_strided.default, (list(dt.shape), list(dt.stride())),
                        {"dtype": dt.dtype, "device": state_of(local).device, "layout": torch.strided,
                         "pin_memory": False})
    name = _name_in_model(rec, dt)
    if name is not None:
        rec.name_storage(full, name)  # portable streams are keyed by it, as the single-process run's are
    init(full)
    _assign_local(dt, full)


def _assign_local(dt: Any, full: torch.Tensor) -> None:
    runs = local_runs(dt.shape, dt.placements, dt.device_mesh.shape, dt.device_mesh.get_coordinate())
    local = dt._local_tensor
    if local_shape(runs) != tuple(local.shape):
        raise _refuse(dt, "an init call", f"its local tensor has shape {tuple(local.shape)} where its placements "
                      f"give {local_shape(runs)}")
    with torch.no_grad():
        local.copy_(take(full, runs))


def _random_like(func: Any, dt: Any, rest: tuple, kwargs: dict) -> Any:
    local = dt._local_tensor
    rec = state_of(local).recorder
    out_dtype = kwargs.get("dtype") or dt.dtype
    full = rec.dispatch(aten.empty_strided.default, (list(dt.shape), list(dt.stride())),
                        {"dtype": out_dtype, "device": state_of(local).device, "layout": torch.strided,
                         "pin_memory": False})
    value = func(full, *rest, **kwargs)
    new_local = rec.dispatch(aten.empty_strided.default, (list(local.shape), list(local.stride())),
                             {"dtype": out_dtype, "device": state_of(local).device, "layout": torch.strided,
                              "pin_memory": False})
    out = DTensor.from_local(new_local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape,
                             stride=dt.stride())
    _assign_local(out, value)
    return out


def _name_in_model(rec: Any, dt: Any) -> str | None:
    """The smallest name ``dt`` has in the traced model, if it is there (cached per trace:
    init code asks for every parameter; an entry is checked against the model when used)."""
    root = rec.root
    if root is None:
        return None
    names = _NAMES.get(rec)
    name = names.get(id(dt)) if names is not None else None
    if name is None or _at(root, name) is not dt:
        names = {}
        for fqn, _, _, _, t in tensor_slots(root):
            if id(t) not in names or fqn < names[id(t)]:
                names[id(t)] = fqn
        _NAMES[rec] = names
        name = names.get(id(dt))
    return name


def _at(root: torch.nn.Module, fqn: str) -> Any:
    module_path, _, attr = fqn.rpartition(".")
    try:
        module = root.get_submodule(module_path)
    except AttributeError:
        return None
    return module._parameters.get(attr, module._buffers.get(attr))


_NAMES: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = weakref.WeakKeyDictionary()  # recorder -> names


def _refuse(dt: Any, what: str, why: str) -> DeferredInitError:
    return DeferredInitError(
        f"fxinit cannot record {what} on a deferred DTensor (placements {tuple(dt.placements)}): {why}",
        hint="see 'Distributed layouts' in docs/failure-modes.md")
