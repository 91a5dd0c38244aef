"""Devices during capture: where a recorded op's result lives in eager construction, and
which devices exist on this machine."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext, _device_constructors

from fxinit.capture.deferred import state_of
from fxinit.capture.schema import SCALAR_FACTORIES
from fxinit.ops import DEVICE_KWARGS

CPU = torch.device("cpu")
META = torch.device("meta")
_CONSTRUCTORS = frozenset(_device_constructors())


def default_device() -> torch.device:
    """Where torch's factories without ``device=`` build (``torch.set_default_device``, ``with
    torch.device``), read without touching that device: a CUDA context on a machine without
    CUDA is a target to record for, not an error. The index is the current device's where the
    device exists (as ``torch.get_default_device`` gives it), else 0."""
    device = None
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            device = mode.device
            break
    if device is None:
        context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
        device = context.device if context is not None else CPU
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    if device_available(device):
        return torch.device(device.type, getattr(torch, device.type).current_device())
    return torch.device(device.type, 0)


def context_constructors() -> frozenset[Any]:
    """The torch functions a device context gives its device to when they are called
    without ``device=`` (torch's own list; ``torch.normal``, ``*_like``, ``from_numpy``, the
    legacy ``torch.Tensor`` are not among them: eager builds those where their inputs are,
    or on the CPU)."""
    return _CONSTRUCTORS


def output_device(func: Any, inputs: list[torch.Tensor], kwargs: dict, intended: torch.device | None,
                  asked: bool = False) -> torch.device:
    """The device eager construction computes ``func``'s result on: an explicit ``device=``,
    else its deferred ``inputs``' (the first non-CPU one of dimension > 0 wins, as a CPU
    scalar combines with a tensor of any device). ``intended``: the device a factory built
    on meta was asked for (``capture.modes``); ``asked``: it was asked for by the caller
    (``zeros_like(x, device="cuda")``, ``x.to("cuda")``), so it wins over ``device=meta``
    even with inputs, where ``meta`` otherwise means "like the input" (``x.new_zeros``)."""
    dev = kwargs.get("device")
    if dev is not None:
        dev = torch.device(dev)
        if dev.type == "meta" and intended is not None and (asked or not inputs):
            return intended
        if dev.type == "meta" and not inputs:
            if func in SCALAR_FACTORIES:
                # ``t[i] = 0`` wraps the scalar on t's device, which is meta underneath;
                # a CPU scalar combines with a tensor of any device, as eager's would.
                return CPU
        if dev.type != "meta" or not inputs:
            return dev  # explicit device; ``x.new_*`` passes x's (meta) device, which means "like x"
    if not inputs:
        return CPU
    devices = [state_of(t).device for t in inputs]
    for t, d in zip(inputs, devices):
        if d.type != "cpu" and t.dim() > 0:
            return d
    for d in devices:
        if d.type != "cpu":
            return d
    return devices[0]


def device_available(device: torch.device) -> bool:
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available and is_available())


def unavailable_to_cpu(nodes: Iterable[fx.Node]) -> dict[torch.device, torch.device]:
    """The devices ``nodes`` ask for that this machine lacks, mapped to the CPU (values read
    while recording are computed there)."""
    devices = {n.kwargs.get(key) for n in nodes if n.op == "call_function" for key in DEVICE_KWARGS}
    return {d: CPU for d in devices
            if isinstance(d, torch.device) and d.type not in ("cpu", "meta") and not device_available(d)}
