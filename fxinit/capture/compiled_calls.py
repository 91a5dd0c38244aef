"""``torch.compile``'d functions called on deferred tensors: refused by name.

Eager's values are the compiled kernels' (Inductor's fused ``w.div_(w.norm(dim=1,
keepdim=True))`` differs from eager's ops in the last bit), and Dynamo would trace the capture
itself. In the constructor or after the trace, a deferred tensor's hooks refuse while Dynamo
traces them (``refuse_compiled_call``); where Dynamo fails on its own before that (torch 2.11),
``trace_init`` turns its error into the same refusal (``compiled_call_refusal``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from fxinit.errors import DeferredInitError


#: True only while torch.compile's Dynamo traces (it answers the call itself): a compiled
#: function called on deferred tensors (``refuse_compiled_call``).
IS_COMPILING = torch.compiler.is_compiling


def refuse_compiled_call(recorder: Any, func: Any) -> None:
    """A ``torch.compile``'d function called on deferred tensors, in the constructor or after:
    eager's values are its compiled kernels', which may round otherwise than the ops fxinit
    would record (a fused reduction, ``exp``), and Dynamo would trace the capture itself.
    Raised from here, where Dynamo stops tracing (``Recorder.fail`` reads ``sys._getframe``): it
    runs, and raises, as plain Python (raised where Dynamo traces, torch 2.11's fails on it)."""
    raise recorder.fail(
        "a torch.compile'd function was called on deferred tensors: its compiled kernels may round otherwise "
        "than the torch ops fxinit records, so fxinit cannot give eager's values",
        op=getattr(func, "__name__", str(func)),
        hint="call the function uncompiled (its eager ops are recorded), or after fxinit.materialize")


#: Dynamo's bytecode tracer: an exception through it was raised while compiling.
_DYNAMO_TRACER = os.path.join(os.path.dirname(torch.__file__), "_dynamo", "symbolic_convert.py")


def _raised_in(exc: BaseException, filename: str) -> bool:
    """Whether ``exc``'s traceback passes through code of ``filename``."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            return True
        tb = tb.tb_next
    return False


def compiled_call_refusal(exc: Exception) -> DeferredInitError | None:
    """The refusal for ``exc`` where it is torch.compile's (Dynamo's) failure on a function
    called with deferred tensors: Dynamo traces into the capture, whose tensors are meta
    underneath, and recording its code op by op would give eager's op values, not the compiled
    kernels' that eager construction computes. None for any other exception."""
    dynamo = sys.modules.get("torch._dynamo.exc")
    if dynamo is None or isinstance(exc, DeferredInitError):
        return None
    if not isinstance(exc, dynamo.TorchDynamoException) and not _raised_in(exc, _DYNAMO_TRACER):
        return None  # (torch 2.11's Dynamo fails there with an AssertionError of its own)
    site = None
    tb = exc.__traceback__
    while tb is not None:  # the last frame of the caller's code before torch's
        path = tb.tb_frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" in path:
            break
        if f"{os.sep}fxinit{os.sep}" not in path:
            site = f"{path}:{tb.tb_lineno}"
        tb = tb.tb_next
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DeferredInitError(
        f"a torch.compile'd function ran while the constructor was traced: Dynamo compiles through fxinit's "
        f"capture, which it cannot (torch.compile's own words, which vary: {type(exc).__name__}: {first[:200]})",
        source=site,
        hint="call the function uncompiled in the constructor (its compiled kernels may round otherwise than "
             "the ops fxinit records), or call it after fxinit.materialize")
