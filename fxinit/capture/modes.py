"""The two PyTorch modes active while a constructor runs under capture.

* CaptureDispatchMode sees every aten op (factories included: ``torch.empty`` has no
  tensor argument to dispatch on) and hands it to the recorder; under ``inference_mode``,
  composite ops reach it whole, and it runs their decomposition as the backend would.
* CaptureFunctionMode sees data constants that never reach the dispatcher
  (``torch.from_numpy``, ``torch.as_tensor``) or would be built on their device first
  (``torch.tensor(data, device=...)``) and turns them into graph constants.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch._C import DispatchKey
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fxinit.capture.deferred import (CLASSES_MADE_AS, PROPERTY_CALL, DeferredTensor, deferred_torch_function,
                                     eager_device, is_deferred_tensor, state_of, subclass_call)
from fxinit.capture.subclass_code import NOT_SUBCLASS_CODE, dispatches_itself, turned_off_by_fxinit, wrappers_dispatch
from fxinit.capture.branches import cpu_branch_call, dropout_call, inexact_branch
from fxinit.capture.devices import context_constructors, default_device
from fxinit.capture.grad_branches import run_as_eager
from fxinit.capture.moves import MOVES, device_of_number, parse_move, with_index
from fxinit.capture.real import SIZE_FROM_INDICES, with_inferred_size
from fxinit.capture.recorder import Recorder
from fxinit.capture.user_modes import refuse_modes_below_every_mode

_CONSTANT_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.frombuffer}
# The factories a device context (``with torch.device``, ``set_default_device``) gives its
# device to, as torch's DeviceContext does; the data constants are the recorder's.
_FACTORIES = context_constructors() - _CONSTANT_FACTORIES


_NEW_TENSOR = torch.Tensor.new_tensor
_SET_GRAD_ENABLED = torch._C._set_grad_enabled
_ONLY_DEFERRED = (DeferredTensor,)
_SUBCLASS_TORCH_FUNCTION_ON = torch._C._is_torch_function_enabled
_AUTOCAST_ON = torch._C._is_any_autocast_enabled
aten = torch.ops.aten
_INFERENCE_MODE = torch.is_inference_mode_enabled
_COMPOSITE = torch._C._dispatch_has_kernel_for_dispatch_key


def _call(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` as torch would next. Where that is DeferredTensor's ``__torch_function__``
    and no other subclass's, call its logic directly (not under DisableTorchFunctionSubclass,
    as the recorder's own reads run: then torch calls no subclass at all)."""
    if types == _ONLY_DEFERRED and _SUBCLASS_TORCH_FUNCTION_ON():
        return deferred_torch_function(func, args, kwargs)
    return func(*args, **kwargs)


class CaptureDispatchMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode otherwise wraps __torch_dispatch__ in torch._dynamo.disable, a
        # cost on every op; capture never runs under torch.compile.
        return False

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.recorder.is_suspended:
            return func(*args, **kwargs)
        refuse_modes_below_every_mode()
        if any(t is not DeferredTensor and dispatches_itself(t) for t in types):
            # A wrapper subclass of other code among the arguments (quanto's, torchao's): its
            # own __torch_dispatch__ takes the call, as in eager, and calls again with the
            # tensors it holds (not lifted as a constant here: that copy ran its copy_).
            if turned_off_by_fxinit():
                with self:  # (as torch runs subclasses' handlers after a mode's NotImplemented)
                    return wrappers_dispatch(func, args, kwargs)
            return NotImplemented
        if _INFERENCE_MODE() and _decomposes(func):
            # Under inference_mode autograd's keys, where composite ops decompose, are off, so
            # one reaches this mode whole (``aten.batch_norm``, whose schema does not say it
            # writes the running statistics: braindecode sizes its layers by a forward under
            # inference_mode). The backend's dispatch would run its decomposition: so does this,
            # the C++ kernel, not ``func.decompose``'s Python one where torch registers one (its
            # ``lstm`` never applies dropout between layers; its ``upsample_*`` round otherwise).
            with self:
                return func._op_dk(DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
        # The recorder reads sizes, strides and storages of deferred tensors: as plain tensors.
        recorder, outside = self.recorder, self.recorder.torch_function_outside
        recorder.torch_function_outside = _SUBCLASS_TORCH_FUNCTION_ON()
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return recorder.dispatch(func, args, kwargs)
        finally:
            recorder.torch_function_outside = outside


class CaptureFunctionMode(TorchFunctionMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        # Where factories without device= build, as set by what is under this mode (a
        # `with torch.device(...)` around trace_init, torch.set_default_device): fixed while
        # it is active, as anything entered later sits above it and passes device= down.
        self._default: torch.device | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        recorder = self.recorder
        if recorder.is_suspended or func is _SET_GRAD_ENABLED:
            return func(*args, **kwargs)  # grad mode (every torch.no_grad): nothing to do
        if CLASSES_MADE_AS and (out := subclass_call(func, args, kwargs)) is not NOT_SUBCLASS_CODE:
            return out  # a Parameter subclass's own code takes the call (capture.subclass_code)
        if type(func) is PROPERTY_CALL:  # property reads and writes: DeferredTensor's to answer
            # ``types`` holds the owner's type only: `real.data = deferred` is DeferredTensor's too.
            if (DeferredTensor in types or isinstance(args[-1], DeferredTensor)) and _SUBCLASS_TORCH_FUNCTION_ON():
                return deferred_torch_function(func, args, kwargs)
            return func(*args, **kwargs)
        outermost = recorder.call_site is None
        inexact = None  # why this call's ops are not eager's on the target device (capture.branches)
        if outermost:
            # Ops recorded during this call come from the code that called it: provenance
            # walks up from there instead of through the frames inside the call.
            recorder.call_site = sys._getframe(1)
            recorder.autocast = _AUTOCAST_ON()
            # A composite (F.one_hot, torch.combinations) builds its helper tensors with its
            # input's options, which are meta underneath: they belong where the input is.
            recorder.composite_device = _deferred_device(args) if func not in _FACTORIES else None
        try:
            device = kwargs.get("device")
            if isinstance(device, int) and not isinstance(device, bool):  # device=0: torch reads the accelerator
                device = device_of_number(device)
                kwargs = {**kwargs, "device": device}
            if func in _CONSTANT_FACTORIES:
                return recorder.constant_from(func, args, kwargs)
            if func is _NEW_TENSOR:  # torch.tensor(data) with its tensor's dtype and device
                return recorder.new_tensor(*args, **kwargs)
            branch = dropout_call(func, args, kwargs) or cpu_branch_call(func, args, kwargs, recorder.suspended)
            if branch is not None:  # the kernel eager's C++ picks on the target device
                return branch()
            if recorder.inexact is None:
                recorder.inexact = inexact = inexact_branch(func, args, kwargs)
            if func in MOVES:
                move = parse_move(func, args, kwargs, eager_device)
                if move is not None and move.device is not None and (move.device.type != "meta"
                                                                     or is_deferred_tensor(move.tensor)):
                    return recorder.moved(move)
            if device is None and func in _FACTORIES:
                if self._default is None:
                    self._default = default_device()
                device = self._default
            out = kwargs.get("out")
            if device is not None and is_deferred_tensor(out) and torch.device(device).type == state_of(out).device.type:
                # ``torch.eye(n, out=w)`` under a device context: w decides, as in eager (w is meta underneath)
                return _call(func, types, args, {**kwargs, "device": "meta"})
            if device is not None and torch.device(device).type not in ("cpu", "meta"):
                # Building on that device first would touch (or need) it; build on meta and
                # let the recorder note the intended device for the factory ops inside.
                kwargs = {**kwargs, "device": "meta"}
                with recorder.intended_device(with_index(torch.device(device))):  # "cuda": the current one
                    return func(*args, **kwargs)
            if func in SIZE_FROM_INDICES:
                args, kwargs = with_inferred_size(recorder, func, args, kwargs)
            # real tensors too: under the capture's dispatch mode C++ takes them for ones that may need gradients
            return run_as_eager(func, args, kwargs, lambda: _call(func, types, args, kwargs))
        finally:
            if inexact is not None:
                recorder.inexact = None
            if outermost:
                recorder.call_site = recorder.composite_device = None


def _decomposes(func: Any) -> bool:
    """Whether ``func`` has a composite kernel that the dispatch below autograd would run:
    not ``set_`` (its decomposition takes the tensor's storage, which a deferred tensor has not
    to give; whole, it is recorded as outside inference mode), nor an op the dispatcher
    does not know by name (Python-only overloads)."""
    if getattr(func, "overloadpacket", None) is aten.set_:
        return False
    try:
        return _COMPOSITE(func.name(), "CompositeImplicitAutograd")
    except RuntimeError:
        return False


def _deferred_device(args: tuple) -> torch.device | None:
    """The intended device of the first deferred tensor among ``args`` (not meta), if any."""
    for a in args:
        if type(a) is DeferredTensor:
            device = state_of(a).device
            return device if device.type != "meta" else None
    return None


def active_modes(recorder: Recorder) -> tuple[Any, Any]:
    return CaptureFunctionMode(recorder), CaptureDispatchMode(recorder)
