"""The two PyTorch modes active while a constructor runs under capture.

* CaptureDispatchMode sees every aten op (factories included: ``torch.empty`` has no
  tensor argument to dispatch on) and hands it to the recorder.
* CaptureFunctionMode sees data constants that never reach the dispatcher
  (``torch.from_numpy``, ``torch.as_tensor``) or would be built on their device first
  (``torch.tensor(data, device=...)``) and turns them into graph constants.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fxinit.capture.recorder import Recorder

_CONSTANT_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer}


class CaptureDispatchMode(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.recorder.is_suspended:
            return func(*args, **kwargs)
        return self.recorder.dispatch(func, args, kwargs)


class CaptureFunctionMode(TorchFunctionMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _CONSTANT_FACTORIES and not self.recorder.is_suspended:
            return self.recorder.constant_from(func, args, kwargs)
        return func(*args, **kwargs)


def active_modes(recorder: Recorder) -> tuple[Any, Any]:
    return CaptureFunctionMode(recorder), CaptureDispatchMode(recorder)
