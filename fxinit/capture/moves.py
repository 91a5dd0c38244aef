"""``Tensor.to``, ``Tensor.cuda``, ``Tensor.cpu``, ``Tensor.type_as`` and ``Tensor.type`` of a
legacy tensor type: where a move sends a tensor, read from its arguments as torch reads them.

Capture reads a move before torch runs it, for two reasons:

* torch initializes the target device while it parses the arguments, so a move onto a
  device this machine lacks (a CUDA target traced on a CPU-only machine) would fail there;
* a deferred tensor is meta underneath, so the move torch sees goes from meta to meta, and
  would return the tensor itself where eager copies it to the other device; and torch reads
  the device of ``t.to(other)`` and ``t.type_as(other)`` from ``other``'s meta underneath.

>>> import torch
>>> from torch._C import TensorBase
>>> m = parse_move(TensorBase.to, (torch.ones(2), "cuda:1", torch.float16), {}, lambda t: t.device)
>>> m.device, m.dtype, m.copy
(device(type='cuda', index=1), torch.float16, False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch._C import TensorBase
from torch._prims_common import suggest_memory_format
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

PARSE_TO = torch._C._nn._parse_to
MOVES = (TensorBase.to, TensorBase.cuda, TensorBase.cpu, TensorBase.type, TensorBase.type_as)


@dataclass(frozen=True)
class Move:
    """One move's request: ``None`` for what it leaves as it is."""

    tensor: torch.Tensor
    device: torch.device | None
    dtype: torch.dtype | None
    non_blocking: bool
    copy: bool
    memory_format: torch.memory_format | None

    def keeps(self, device: torch.device, dtype: torch.dtype, layout: torch.Tensor) -> bool:
        """Whether eager answers this move of a tensor on ``device`` of ``dtype`` with the tensor
        itself (torch's ``to_will_alias``: the same device, an index left out meaning the
        current one; the same dtype; no copy asked; the format ``layout``'s strides suggest).
        ``layout``: a tensor with the strides of the one moved (meta underneath is fine)."""
        if self.copy or (self.dtype is not None and self.dtype != dtype):
            return False
        if self.device is not None and with_index(self.device) != with_index(device):
            return False
        if self.memory_format in (None, torch.preserve_format):
            return True
        with torch._C.DisableTorchFunctionSubclass():
            return suggest_memory_format(layout) == self.memory_format

    def to_kwargs(self, device: torch.device, copy: bool) -> dict[str, Any]:
        """``Tensor.to``'s keyword arguments for this move onto ``device``."""
        kwargs: dict[str, Any] = {"device": device, "non_blocking": self.non_blocking, "copy": copy}
        if self.dtype is not None:
            kwargs["dtype"] = self.dtype
        if self.memory_format is not None:
            kwargs["memory_format"] = self.memory_format
        return kwargs


def parse_move(func: Any, args: tuple, kwargs: dict, device_of: Callable[[torch.Tensor], torch.device]
               ) -> Move | None:
    """The move ``func(*args, **kwargs)`` asks for, or None where ``func`` is not a move or torch
    would refuse its arguments (then torch says why). ``device_of``: a tensor's device in
    eager construction (a deferred tensor's intended one), for ``t.to(other)``."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    t = args[0]
    if func is TensorBase.cpu:
        return Move(t, torch.device("cpu"), None, False, False, kwargs.get("memory_format"))
    if func is TensorBase.cuda:
        return _cuda_move(t, args[1:], kwargs)
    if func is TensorBase.type:
        return _legacy_type(t, args[1:], kwargs, device_of(t))
    if func is TensorBase.type_as:
        other = args[1] if len(args) > 1 else kwargs.get("other")
        return Move(t, device_of(other), other.dtype, False, False, None) if isinstance(other, torch.Tensor) else None
    if func is not TensorBase.to:
        return None
    rest, kw = [_device_number(a) for a in args[1:]], dict(kwargs)
    copy = bool(kw.pop("copy", False))
    if "device" in kw:
        kw["device"] = _device_number(kw["device"])
    other = rest[0] if rest and isinstance(rest[0], torch.Tensor) else None
    try:
        device, dtype, non_blocking, memory_format = PARSE_TO(*rest, **kw)
    except (TypeError, RuntimeError):  # torch says "does not accept copy argument" with a RuntimeError
        if not rest or not isinstance(rest[-1], bool):
            return None
        copy = copy or rest.pop()  # to(dtype, non_blocking, copy) and the like: copy is last
        try:
            device, dtype, non_blocking, memory_format = PARSE_TO(*rest, **kw)
        except (TypeError, RuntimeError):
            return None
    if other is not None:
        device = device_of(other)  # torch would read a deferred tensor's meta underneath
    return Move(t, device, dtype, bool(non_blocking), copy, memory_format)


def _legacy_type(t: torch.Tensor, rest: tuple, kwargs: dict, here: torch.device) -> Move | None:
    """``t.type(torch.cuda.FloatTensor)``, ``t.type("torch.HalfTensor")``: a move to the CPU
    or onto CUDA (the GPU ``t`` is on, if it is on one); other forms are torch's to answer."""
    kind = rest[0] if rest else kwargs.get("dtype")
    if isinstance(kind, str) and kind.startswith("torch."):
        module, _, name = kind[len("torch."):].rpartition(".")
        kind = getattr(torch.cuda if module == "cuda" else torch, name, None) if module in ("", "cuda") else None
    if not isinstance(kind, type) or not isinstance(getattr(kind, "dtype", None), torch.dtype):
        return None
    cuda = getattr(kind, "is_cuda", False)
    device = (here if here.type == "cuda" else torch.device("cuda")) if cuda else torch.device("cpu")
    non_blocking = rest[1] if len(rest) > 1 else kwargs.get("non_blocking", False)
    return Move(t, device, kind.dtype, bool(non_blocking), False, kwargs.get("memory_format"))


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index: a device type left without one means the current device of
    that type (torch's ``ensure_has_index``), or 0 where this machine lacks the type."""
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    module = getattr(torch, device.type, None)
    available, current = getattr(module, "is_available", None), getattr(module, "current_device", None)
    index = current() if available is not None and current is not None and available() else 0
    return torch.device(device.type, index)


def device_of_number(index: int) -> torch.device:
    """What torch makes of ``device=0``: the accelerator's device of that index; CUDA's where
    this machine has no accelerator (the target fxinit records for without one)."""
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    return torch.device(current.type if current is not None else "cuda", index)


def _device_number(value: Any) -> Any:
    return device_of_number(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _cuda_move(t: torch.Tensor, rest: tuple, kwargs: dict) -> Move | None:
    """``t.cuda(device=None, non_blocking=False, memory_format=torch.preserve_format)``."""
    names = ("device", "non_blocking", "memory_format")
    if len(rest) > len(names) or any(k not in names for k in kwargs):
        return None
    given = {**dict(zip(names, rest)), **kwargs}
    device = given.get("device")
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    elif device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
    return Move(t, device if device is not None else torch.device("cuda"), None,
                bool(given.get("non_blocking", False)), False, given.get("memory_format"))


def shallow_copy_kind(device: torch.device, layout: torch.layout) -> tuple[torch.layout, bool]:
    """What ``torch._has_compatible_shallow_copy_type`` compares of a tensor on ``device``: one
    layout on real devices is one kind (``Module.cuda()`` keeps the parameter objects, through
    ``param.data = new``), the same on meta another (``to_empty`` from meta makes new ones)."""
    return layout, device.type == "meta"


_LEGACY_NAMES: dict[torch.dtype, str] = {}


def legacy_type_name(device: torch.device, dtype: torch.dtype) -> str:
    """``t.type()`` of a tensor on ``device`` of ``dtype``: ``torch.HalfTensor``, ``torch.cuda.HalfTensor``."""
    name = _LEGACY_NAMES.get(dtype)
    if name is None:  # torch's own name, from a CPU tensor no mode sees
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            name = _LEGACY_NAMES[dtype] = FACTORIES.empty(0, dtype=dtype).type()[len("torch."):]
    return "torch." + ("" if device.type == "cpu" else f"{device.type}.") + name
