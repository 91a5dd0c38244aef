"""Native code outside torch's ops that reads a deferred tensor's memory: a C/C++ extension
function (pybind11, ``torch.utils.cpp_extension``) called in a constructor. No torch hook sees
such a call, so the capture cannot record it; the extension reads the meta memory underneath a
deferred tensor and torch raises its own error, which names nothing of the caller's. This turns
it into a refusal by name, with the line that made the call."""

from __future__ import annotations

import os

from fxinit.capture.deferred import META_DATA_ACCESS
from fxinit.errors import DeferredInitError

#: torch's errors where C++ asks for the memory of a tensor that has none (meta underneath)
_NO_MEMORY = (META_DATA_ACCESS, "Cannot access data pointer of Tensor that doesn't have storage")


def native_read_refusal(exc: Exception) -> DeferredInitError | None:
    """The refusal for ``exc`` where it is torch's error for native code that read a deferred
    tensor's memory (None for any other exception)."""
    if type(exc) is not RuntimeError or not any(text in str(exc) for text in _NO_MEMORY):
        return None
    tb, site = exc.__traceback__, None
    while tb is not None:  # the last Python line: the one that called into native code
        if f"{os.sep}fxinit{os.sep}" not in tb.tb_frame.f_code.co_filename:
            site = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return DeferredInitError(
        "native code outside torch's ops (a C/C++ extension function) read the memory of a deferred tensor: "
        "no torch hook sees such a call, so fxinit cannot record it, and a deferred tensor has no memory while "
        "it is traced", op="a native extension call", source=site,
        hint="give the extension real tensors (made before or outside the trace), call it after "
             "fxinit.materialize, or use the library's pure-PyTorch path where it has one (torch-harmonics' "
             "DISCO convolutions: optimized_kernel=False)")
