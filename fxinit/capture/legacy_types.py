"""The legacy typed tensor classes during capture: ``torch.FloatTensor(t)`` of a deferred ``t``.

``torch.FloatTensor``, ``torch.cuda.LongTensor`` & co. are objects of torch's C type
``tensortype``; calling one with a tensor returns an alias of it after C++ checks that its
dtype and device are the class's. No ``__torch_function__`` sees the call, and C++ sees a
deferred tensor's meta storage: the check failed where eager's passes (schnetpack's
``GaussianRBF``, in every SchNet and PaiNN: ``torch.FloatTensor(width * torch.ones_like(offset))``).

While a capture is on, ``torch.<T>Tensor`` and ``torch.cuda.<T>Tensor`` are stand-ins that
answer that call as eager does, from the deferred tensor's dtype and eager device (the alias,
recorded; torch's ``TypeError`` where the two differ), and send every other call, ``isinstance``,
attribute and pickling to torch's class (a deferred tensor is an instance of the class of its
dtype and eager device, as in eager). A stand-in kept beyond the capture behaves as torch's
class (pickled by name, it is torch's), except where C++ takes it (``t.type(kept)``,
``torch.set_default_tensor_type(kept)``).

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

import contextlib
import threading
import types
from typing import Any, Iterator

import torch

from fxinit.capture.deferred import eager_device, is_deferred_tensor

aten = torch.ops.aten

_lock = threading.Lock()
_entered = 0  # captures under way (one patch for all)


def _torch_classes() -> list[tuple[types.ModuleType, str, Any]]:
    """``(module, name, class)`` of every legacy typed tensor class of torch."""
    tensortype = type(torch.FloatTensor)
    return [(module, name, getattr(module, name)) for module in (torch, torch.cuda) for name in dir(module)
            if name.endswith("Tensor") and type(getattr(module, name, None)) is tensortype]


_CLASSES = _torch_classes()  # (read at import: no capture is on, these are torch's)


def _options(dtype: torch.dtype, device: str) -> str:
    return f"TensorOptions(dtype={str(dtype).removeprefix('torch.')}, device={device}, layout=Strided)"


class _StandIn(type):
    """The metaclass of the stand-ins: each stands for ``cls._torch_class``."""

    _torch_class: Any

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


_STAND_INS: dict[int, _StandIn] = {}  # id(torch's class) -> its stand-in (made once)


def _stand_in(torch_class: Any) -> _StandIn:
    found = _STAND_INS.get(id(torch_class))
    if found is None:
        # named as torch's class: pickle finds it there while it stands in, and torch's class after
        found = _STAND_INS[id(torch_class)] = _StandIn(torch_class.__name__, (), {
            "_torch_class": torch_class, "__module__": torch_class.__module__, "__qualname__": torch_class.__name__})
    return found


@contextlib.contextmanager
def legacy_types() -> Iterator[None]:
    """While capture is on, the legacy typed classes are their stand-ins."""
    global _entered
    with _lock:
        if not _entered:
            for module, name, cls in _CLASSES:
                setattr(module, name, _stand_in(cls))
        _entered += 1
    try:
        yield
    finally:
        with _lock:
            _entered -= 1
            if not _entered:
                for module, name, cls in _CLASSES:
                    setattr(module, name, cls)
