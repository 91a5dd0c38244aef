"""Checks of the arguments users pass to materialize, InitGraph.materialize and save, at the
door: a wrong seed, dtype or device raises at once, before any value is computed, with the
value that was wrong — not a torch error from deep inside the run, after the work."""

from __future__ import annotations

from typing import Any

import torch

from fxinit.capture.devices import device_available
from fxinit.errors import DeferredInitError


def checked_seed(seed: Any) -> int | None:
    """``None`` or an ``int`` (not a bool, a float or a string)."""
    if seed is None or (isinstance(seed, int) and not isinstance(seed, bool)):
        return seed
    raise TypeError(f"seed={seed!r}: the portable stream's seed is an int")


def checked_dtype(dtype: Any) -> torch.dtype | None:
    """A floating-point or complex ``torch.dtype``, or its name (``"bfloat16"``, ``"torch.float16"``)."""
    if isinstance(dtype, str):
        named = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"dtype={dtype!r} names no torch dtype")
        dtype = named
    if dtype is not None and not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)):
        raise TypeError(f"dtype={dtype}: like Module.to, materialize takes a floating-point or complex dtype")
    return dtype


def checked_device(device: Any) -> torch.device | None:
    """A device this machine has (``meta`` included), or ``None``."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r}: {exc}") from exc
    if device.type not in ("cpu", "meta") and not device_available(device):
        raise DeferredInitError(f"device={str(device)!r} is not available on this machine (torch "
                                f"{torch.__version__} sees no {device.type})",
                                hint="materialize on a device this machine has, e.g. device='cpu'")
    return device
