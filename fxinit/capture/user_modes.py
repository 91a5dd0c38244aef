"""PyTorch dispatch modes of the caller's, active while a constructor is traced.

fxinit's capture is a ``TorchDispatchMode`` of its own, entered by ``trace_init``: a mode the
caller entered before (a ``TorchDispatchMode`` that changes results, ``FlopCounterMode``,
``FakeTensorMode``) sits below it and never sees the constructor's ops as eager's would, so
what it does to them (its own results, fake tensors, a count) was lost, silently. A mode entered
inside the constructor sits above the capture and sees them as in eager, but torch's own fake
and proxy modes, which run below every other mode whatever the order. Those are refused by
name here, with the way out.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from fxinit.errors import DeferredInitError

_BELOW_EVERY_MODE = tuple(key for name in ("FAKE", "PROXY")
                          if (key := getattr(torch._C._TorchDispatchModeKey, name, None)) is not None)


def refuse_modes_below(own: type) -> None:
    """Refuse a trace that begins under a dispatch mode that is not fxinit's (``own``: its class)."""
    theirs = [type(m).__name__ for m in _get_current_dispatch_mode_stack()
              if not isinstance(m, own) and not type(m).__module__.startswith("fxinit.")]
    if theirs:
        raise DeferredInitError(
            f"the constructor is traced under a TorchDispatchMode entered before the trace ({', '.join(theirs)}): "
            "fxinit records its ops below that mode, so what the mode does to them (its results, fake tensors, "
            "a count) would be lost",
            op=theirs[0],
            hint="enter the mode inside the constructor, or around the init steps after the trace, or around "
                 "fxinit.materialize and the code after it")


def refuse_modes_below_every_mode() -> None:
    """Refuse an op recorded while torch's fake or proxy mode is active (entered inside the
    constructor: they run below every other mode, fxinit's capture included)."""
    for key in _BELOW_EVERY_MODE:
        mode = torch._C._get_dispatch_mode(key)
        if mode is not None:
            raise DeferredInitError(
                f"{type(mode).__name__} is active inside the traced constructor: it runs below fxinit's capture, "
                "which records the ops as real ones, where eager's results are its fake tensors",
                op=type(mode).__name__,
                hint="trace without it, or build the fake model with eager construction under the mode")
