"""Devices during capture: where a recorded op's result lives in eager construction, and
which devices exist on this machine."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from fxinit.capture.deferred import state_of
from fxinit.capture.schema import SCALAR_FACTORIES
from fxinit.errors import DeferredInitError

CPU = torch.device("cpu")
META = torch.device("meta")


def default_device() -> torch.device:
    """Where factories without ``device=`` build (``torch.set_default_device``, ``with torch.device``)."""
    try:
        return torch.get_default_device()
    except (AssertionError, RuntimeError) as exc:  # e.g. torch.device("cuda") on a CPU-only build
        raise DeferredInitError(
            f"the default device is not usable here: {exc}",
            hint="trace on a machine with that device, or construct for the CPU and materialize with device=...",
        ) from exc


def output_device(func: Any, inputs: list[torch.Tensor], kwargs: dict, intended: torch.device | None
                  ) -> torch.device:
    """The device eager construction computes ``func``'s result on: an explicit ``device=``,
    else its deferred ``inputs``' (the first non-CPU one of dimension > 0 wins, as a CPU
    scalar combines with a tensor of any device). ``intended``: the device a factory built
    on meta was asked for (``capture.modes``)."""
    dev = kwargs.get("device")
    if dev is not None:
        dev = torch.device(dev)
        if dev.type == "meta" and not inputs:
            if intended is not None:
                return intended
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
    devices = {n.kwargs.get("device") for n in nodes if n.op == "call_function"}
    return {d: CPU for d in devices
            if isinstance(d, torch.device) and d.type not in ("cpu", "meta") and not device_available(d)}
