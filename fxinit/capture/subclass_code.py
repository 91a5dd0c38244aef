"""The Python code of ``nn.Parameter`` subclasses and tensor subclasses, run for the deferred
tensors made as them.

A deferred tensor's type is fxinit's ``DeferredTensor`` (torch's dispatch reads it); it says
it is the class it was made as through ``__class__`` (``isinstance``: ``capture.deferred``).
Python looks methods up on the type, so a subclass's own methods would be skipped and the
result be a plain parameter's, silently: bitsandbytes' ``Params4bit.to`` quantizes on a move
(``Module.to`` / ``_apply`` call it), and its ``__torch_function__`` keeps the class of
``torch.chunk``'s pieces. Eager runs that code; so does fxinit, with the deferred tensor as
``self``:

* a method of ``torch.Tensor`` that the subclass defines again (``to``, ``cuda``, ``cpu``):
  that method, for ``self``;
* a function of torch (``torch.chunk``, ``torch.split``, ``nn.init.*``) on a deferred tensor
  whose class defines ``__torch_function__``: that ``__torch_function__``. Its own call to
  ``super().__torch_function__`` runs the op as a plain tensor's (``Parameter`` disables the
  protocol), which reaches fxinit's dispatch. Tensor methods and attributes keep fxinit's
  handling (which stands for a plain tensor's, as the subclass's ``super()`` would);
* any call on a deferred tensor made as a tensor subclass that is not a parameter
  (``t.as_subclass(cls)``), methods included: ``cls.__torch_function__``, its own or torch's,
  which gives results of ``cls`` (an alias made as it); its own calls re-enter it, its
  ``super()`` call is torch's op, as in eager. Attributes keep fxinit's handling.

While the subclass's code runs for a tensor, the same method of that tensor (its ``super()``
call) is torch's. Attributes only the subclass has (``Params4bit._quantize``) are found on it
(``DeferredTensor.__getattr__``, asked only where the type has none).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_PARAMETER_MRO = frozenset(torch.nn.Parameter.__mro__)
_running = threading.local()  # (id of the tensor or class, name) of the subclass code running now
NOT_SUBCLASS_CODE = object()


def defines(cls: type, name: str) -> bool:
    """Whether ``cls`` or a base of it below ``nn.Parameter`` defines ``name``."""
    return any(name in vars(k) for k in cls.__mro__ if k not in _PARAMETER_MRO)


def subclass_attribute(t: torch.Tensor, cls: type, name: str) -> Any:
    """Attribute ``name`` of ``cls`` for ``t`` (a method bound to it, a property's value), as
    ``getattr`` finds it on an object of ``cls``; AttributeError where ``cls`` has none."""
    for k in cls.__mro__:
        if name in vars(k):
            found = vars(k)[name]
            return found.__get__(t, cls) if hasattr(found, "__get__") else found
    raise AttributeError(f"'{cls.__name__}' object has no attribute '{name}'")


def dispatches_itself(cls: type) -> bool:
    """Whether tensors of ``cls`` take aten calls in a ``__torch_dispatch__`` of their own (a
    wrapper subclass: quanto's ``QTensor``, torchao's ``NF4Tensor``); torch gives them those
    calls with their arguments as they are, and so does the capture."""
    return cls.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl


_DECLINED = object()  # (``_protocol``: every handler returned NotImplemented)


def other_codes_torch_function(func: Any, types: tuple, args: tuple, kwargs: dict, own: type) -> Any:
    """``func`` where tensors of other code's subclasses (real ones, quanto's ``QTensor``)
    meet deferred tensors, as torch's protocol runs it without ``own`` (DeferredTensor) among
    the ``types``: their ``__torch_function__`` first, their own or torch's (which gives
    results of their class: ``class Sub(torch.Tensor): pass``), in torch's order.
    ``NOT_SUBCLASS_CODE`` where each returns ``NotImplemented``: fxinit's own handling then."""
    # (torch lists the classes whose handler is on; for a Python function, plain tensors' too)
    others = [t for t in types if not issubclass(t, own) and t is not torch.Tensor]
    out = _protocol("__torch_function__", func, args, kwargs, others) if others else _DECLINED
    return NOT_SUBCLASS_CODE if out is _DECLINED else out


def _protocol(name: str, func: Any, args: tuple, kwargs: dict, classes: list[type]) -> Any:
    """``func`` as torch's protocol ``name`` (``__torch_function__``, ``__torch_dispatch__``)
    runs it for arguments of ``classes`` (in the arguments' order): each class's handler in
    turn, a subclass before its bases, all the classes as ``types``, the next one where a
    handler returns ``NotImplemented``; ``_DECLINED`` where each does. (Its handlers' own calls
    re-enter it, as eager's do.)"""
    order: list[type] = []
    for c in classes:
        if c in order:
            continue
        before = next((i for i, o in enumerate(order) if issubclass(c, o)), len(order))
        order.insert(before, c)
    types = tuple(order)
    for c in order:
        out = getattr(c, name)(func, types, args, kwargs)
        if out is not NotImplemented:
            return out
    return _DECLINED


def wrappers_dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` as torch's ``__torch_dispatch__`` protocol runs it for the tensors of classes that
    dispatch themselves among ``args`` and the tensors in their lists (a wrapper of other code
    meeting deferred tensors), with subclasses' ``__torch_function__`` on, as it is in eager
    where no ``__torch_function__`` took the call before (fxinit's did, for the deferred
    tensors: ``turned_off_by_fxinit``). ``NotImplemented`` where each handler declines."""
    classes = [type(x) for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (list, tuple)) else (a,))
               if isinstance(x, torch.Tensor) and dispatches_itself(type(x))]
    off, TORCH_FUNCTION_OFF.by_fxinit = TORCH_FUNCTION_OFF.by_fxinit, False
    try:
        with torch._C._EnableTorchFunction():
            out = _protocol("__torch_dispatch__", func, args, kwargs, classes)
    finally:
        TORCH_FUNCTION_OFF.by_fxinit = off
    return NotImplemented if out is _DECLINED else out


class _TorchFunctionOff(threading.local):
    by_fxinit = False  # subclasses' __torch_function__ is off because fxinit's handler turned it off


TORCH_FUNCTION_OFF = _TorchFunctionOff()


def turned_off_by_fxinit() -> bool:
    """Whether subclasses' ``__torch_function__`` is off because fxinit's own handler for
    deferred tensors turned it off around an op (``TORCH_FUNCTION_OFF``, which it sets),
    where eager may have had no handler to (a parameter, a plain tensor); a subclass's
    ``super().__torch_function__`` turns it off in eager too."""
    return TORCH_FUNCTION_OFF.by_fxinit and not torch._C._is_torch_function_enabled()


def _most_derived(classes: list[type]) -> type | None:
    """The class torch asks first: one no other of ``classes`` derives from."""
    return next((c for c in classes if not any(o is not c and issubclass(o, c) for o in classes)), None)


def _tensor_method(func: Any) -> str | None:
    name = getattr(func, "__name__", None)
    return name if name is not None and getattr(torch.Tensor, name, None) is func else None


def run_subclass_code(func: Any, args: tuple, kwargs: dict, made_as: dict[int, type]) -> Any:
    """``func(*args, **kwargs)`` as eager runs it where a subclass's own code takes the call,
    or ``NOT_SUBCLASS_CODE``. ``made_as``: the class each deferred argument was made as, by
    position (0: ``self`` of a method; keyword arguments after the positional ones, tensors in
    lists at negative positions)."""
    running = _running.__dict__.setdefault("keys", set())
    name = _tensor_method(func)
    if name is not None and (cls := made_as.get(0)) is not None and defines(cls, name) \
            and (key := (id(args[0]), name)) not in running:
        code = getattr(cls, name)
    elif any(not issubclass(c, torch.nn.Parameter) for c in made_as.values()) and \
            getattr(func, "__name__", None) not in ("__get__", "__set__"):
        # A tensor subclass (``as_subclass``): its ``__torch_function__``, its own or torch's (which
        # gives results of its class), takes every call, methods included, as in eager.
        if not torch._C._is_torch_function_enabled():  # (inside its ``super()`` call: torch's op, as in eager)
            return NOT_SUBCLASS_CODE
        classes = [made_as[i] for i in sorted(made_as, key=lambda i: (i < 0, abs(i)))
                   if not issubclass(made_as[i], torch.nn.Parameter)]
        out = _protocol("__torch_function__", func, args, kwargs, classes)
        if out is _DECLINED:
            raise TypeError(f"no implementation found for '{getattr(func, '__name__', func)}' on types that "
                            f"implement __torch_function__: {classes}")
        return out
    elif name is not None:
        return NOT_SUBCLASS_CODE
    else:
        if getattr(func, "__name__", None) in ("__get__", "__set__"):  # attributes: fxinit's handling
            return NOT_SUBCLASS_CODE
        cls = _most_derived([c for c in made_as.values() if defines(c, "__torch_function__")])
        key = (id(cls), "__torch_function__")
        if cls is None or key in running:
            return NOT_SUBCLASS_CODE
        code = lambda *a, **k: cls.__torch_function__(func, (cls,), a, k)  # noqa: E731
    running.add(key)
    try:
        return code(*args, **kwargs)
    finally:
        running.discard(key)
