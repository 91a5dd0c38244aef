"""The legacy typed tensor classes during capture: ``torch.FloatTensor(t)`` of a deferred ``t``.

``torch.FloatTensor``, ``torch.cuda.LongTensor`` & co. are objects of torch's C type
``tensortype``; calling one with a tensor returns an alias of it after C++ checks that its
dtype and device are the class's. No ``__torch_function__`` sees the call, and C++ sees a
deferred tensor's meta storage: the check failed where eager's passes (schnetpack's
``GaussianRBF``, in every SchNet and PaiNN: ``torch.FloatTensor(width * torch.ones_like(offset))``).

While a capture is on, ``torch.<T>Tensor`` and ``torch.cuda.<T>Tensor`` are stand-ins that
answer that call as eager does, from the deferred tensor's dtype and eager device (the alias,
recorded; torch's ``TypeError`` where the two differ), and send every other call, ``isinstance``,
attribute, copy and pickle to torch's class (a deferred tensor is an instance of the class of its
dtype and eager device, as in eager). A stand-in is a class whose C-level name is torch's full
name, which torch's C++ reads where it takes the class (``t.type(torch.FloatTensor)``), also in
other threads while the capture is on and where code keeps one (``self.Tensor =
torch.FloatTensor``); annotations (``torch.FloatTensor | None`` in a module imported during the
capture) work as with torch's. ``torch.set_default_tensor_type`` takes it while the capture is
on. What differs: ``type(torch.FloatTensor)`` is fxinit's, and a reference taken before the
capture (``from torch import FloatTensor``) is torch's class, which C++ checks: that call is
refused by name.

    >>> import torch, fxinit
    >>> class Widths(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         offset = torch.linspace(0.0, 4.0, 5)
    ...         self.register_buffer("widths", torch.FloatTensor((offset[1] - offset[0]) * torch.ones_like(offset)))
    >>> fxinit.materialize(fxinit.trace_init(Widths)).widths.tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import copyreg
import importlib
import os
import types
from typing import Any

import torch

from fxinit.capture.deferred import eager_device, is_deferred_tensor
from fxinit.capture.patches import WhileCapturing
from fxinit.errors import DeferredInitError

aten = torch.ops.aten


def _torch_classes() -> list[tuple[types.ModuleType, str, Any]]:
    """``(module, name, class)`` of every legacy typed tensor class of torch."""
    tensortype = type(torch.FloatTensor)
    return [(module, name, getattr(module, name)) for module in (torch, torch.cuda) for name in dir(module)
            if name.endswith("Tensor") and type(getattr(module, name, None)) is tensortype]


_CLASSES = _torch_classes()  # (read at import: no capture is on, these are torch's)


def _options(dtype: torch.dtype, device: str) -> str:
    return f"TensorOptions(dtype={str(dtype).removeprefix('torch.')}, device={device}, layout=Strided)"


class _Module:
    """A module, pickled as its import (``importlib.import_module(name)``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return importlib.import_module, (self.name,)


class _StandIn(type):
    """The type of the stand-ins: each is a class standing for torch's ``cls._torch_class``. Its
    C-level name is torch's full name (``torch.FloatTensor``), which torch's C++ reads where it
    takes a class (``t.type(T)``, also in other threads while the capture is on, and where code
    keeps one); ``__name__``, ``__module__``, ``__qualname__``, ``repr``, ``T | None``,
    ``isinstance``, attributes and pickling answer as torch's class does."""

    _torch_class: Any

    @property
    def __name__(cls) -> str:  # type: ignore[override]
        return cls._torch_class.__name__

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and is_deferred_tensor(args[0]):
            t = args[0]
            want = cls._torch_class
            device = eager_device(t)
            if t.dtype != want.dtype or (device.type == "cuda") != want.is_cuda or device.type not in ("cpu", "cuda"):
                raise TypeError(f"expected {_options(want.dtype, 'cuda' if want.is_cuda else 'cpu')} "
                                f"(got {_options(t.dtype, device)})")
            return aten.alias.default(t)
        return cls._torch_class(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        want = cls._torch_class
        if is_deferred_tensor(obj):
            device = eager_device(obj)
            return obj.dtype == want.dtype and device.type == ("cuda" if want.is_cuda else "cpu") \
                and not obj.is_sparse
        return isinstance(obj, want)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return sub is cls or issubclass(sub, cls._torch_class)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls._torch_class, name)

    def __repr__(cls) -> str:
        return repr(cls._torch_class)

    def __eq__(cls, other: object) -> bool:
        return other is cls or other is cls._torch_class

    def __hash__(cls) -> int:
        return hash(cls._torch_class)


def _stand_in(torch_class: Any) -> _StandIn:
    return _StandIn(f"{torch_class.__module__}.{torch_class.__name__}", (), {
        "_torch_class": torch_class, "__module__": torch_class.__module__, "__qualname__": torch_class.__name__,
        "__doc__": torch_class.__doc__})


# pickled as what torch holds under the name when loaded (torch's class after the capture)
copyreg.pickle(_StandIn, lambda cls: (getattr, (_Module(cls._torch_class.__module__), cls._torch_class.__name__)))
_STAND_INS = {id(cls): _stand_in(cls) for _, _, cls in _CLASSES}  # id(torch's class) -> its stand-in


_SET_DEFAULT_TENSOR_TYPE = torch.set_default_tensor_type


def _set_default_tensor_type(t: Any) -> None:
    """``torch.set_default_tensor_type``, whose C++ takes only the class itself (its Python
    turns a name into what ``torch`` holds under it: a stand-in while a capture is on)."""
    if isinstance(t, str) and not isinstance(t, _StandIn):
        t = torch._utils._import_dotted_name(t)
    _SET_DEFAULT_TENSOR_TYPE(t._torch_class if isinstance(t, _StandIn) else t)


_set_default_tensor_type.__doc__ = _SET_DEFAULT_TENSOR_TYPE.__doc__


def _install() -> None:
    for module, name, cls in _CLASSES:
        setattr(module, name, _STAND_INS[id(cls)])
    torch.set_default_tensor_type = _set_default_tensor_type


def _uninstall() -> None:
    for module, name, cls in _CLASSES:
        setattr(module, name, cls)
    torch.set_default_tensor_type = _SET_DEFAULT_TENSOR_TYPE


#: While capture is on, the legacy typed classes are their stand-ins.
legacy_types = WhileCapturing(_install, _uninstall)


def legacy_type_refusal(exc: Exception) -> DeferredInitError | None:
    """The refusal for ``exc`` where it is torch's check of a legacy class given a deferred
    tensor through a reference taken before the capture (``from torch import FloatTensor``):
    C++ saw the meta storage underneath. None for any other exception."""
    text = str(exc)
    if type(exc) is not TypeError or not text.startswith("expected TensorOptions(") or "device=meta" not in text:
        return None
    tb, site = exc.__traceback__, None
    while tb is not None:  # the caller's last line
        if f"{os.sep}fxinit{os.sep}" not in tb.tb_frame.f_code.co_filename:
            site = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return DeferredInitError(
        "a legacy tensor class (torch.FloatTensor & co.) taken before the trace was given a deferred tensor: torch "
        "checks it in C++, where a deferred tensor is on meta", op="torch.<T>Tensor(tensor)", source=site,
        hint="refer to it through torch (torch.FloatTensor(t)), which fxinit answers as eager while it records, "
             "or use t.float() / t.long()")
