"""TorchScript functions and methods called on deferred tensors.

TorchScript reads a tensor in C++, where a deferred tensor is the meta tensor underneath: a
scripted function that branches on ``x.device`` took the meta branch, and one that builds a
tensor on ``x.device`` (e3nn's ``spherical_harmonics_alpha``: ``torch.arange(...,
device=alpha.device)``) built it on meta. Recorded as they ran, those gave other values than
eager's, or a tensor left meta after materialize, silently (found by a sweep of fairchem's
UMA, EquiformerV2 and eSEN). Running the Python function a script was compiled from instead
is not TorchScript either: it converts arguments to their annotated types (``3`` for a
``float`` is ``3.0``), its ``round`` returns a float, ``torch.jit.is_scripting()`` says True
in every function it compiled.

So a call with a deferred tensor among its arguments runs TorchScript itself, traced by
torch's ``make_fx`` on fake tensors that tell C++ ``cpu``, as ``capture.branches`` traces
composites that branch on the device (``fake_cpu_trace``); the ops of that trace are then
run on the deferred tensors, which records them. That is TorchScript's own result where:

* every deferred argument is meant for the CPU, where TorchScript fuses nothing
  (``torch._C._jit_can_fuse_on_cpu()`` is off, as by default); on a GPU its fuser may run a
  chain of ops as one kernel of other bits;
* factories without ``device=`` build on the CPU: TorchScript does not see a device context
  (``with torch.device("cuda")``), and the replayed factories would.

Where make_fx cannot trace the call (it reads values: ``.item()``, a branch on a sum), the
call runs on the meta tensors underneath, as it did before, if nothing in its graph asks
their device or takes a kernel by it (:func:`reads_the_device`); otherwise, and where the
conditions above fail, it is refused by name.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.jit._state import _get_script_class
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_modes

from fxinit.capture.branches import fake_cpu_trace
from fxinit.capture.deferred import eager_device, is_deferred_tensor, state_of
from fxinit.capture.devices import default_device
from fxinit.capture.subclass_code import dispatches_itself

_FUNCTION_CALL = torch.jit.ScriptFunction.__call__
_METHOD_CALL = torch._C.ScriptMethod.__call__

#: nodes of a TorchScript graph that ask a tensor's device, or whose kernel depends on it
#: (``capture.branches`` lists the composites): on a meta tensor they answer otherwise
_DEVICE_NODES = frozenset((
    "prim::device", "prim::data", "prim::tolist", "aten::get_device", "aten::to", "aten::cpu", "aten::cuda",
    "aten::type_as", "aten::data_ptr", "aten::is_pinned", "aten::pin_memory", "aten::dropout", "aten::dropout_",
    "aten::scaled_dot_product_attention", "aten::lstm", "aten::gru", "aten::rnn_tanh", "aten::rnn_relu",
    "aten::lstm_cell", "aten::gru_cell", "aten::group_norm", "aten::batch_norm", "aten::instance_norm",
    "aten::grid_sampler", "aten::ctc_loss", "aten::softmax", "aten::log_softmax"))


def reads_the_device(graph: torch._C.Graph) -> str | None:
    """The first node of ``graph`` (inlined: its callees' nodes too) that asks a tensor's
    device or takes a kernel by it (``x.device``, ``x.is_cuda``, ``x.to(...)``, dropout),
    or None."""
    for node in graph.nodes():
        kind = node.kind()
        if kind in _DEVICE_NODES or kind.startswith("prim::is_"):
            return kind
        for block in node.blocks():
            found = reads_the_device(block)
            if found is not None:
                return found
    return None


def _why_not_traced(deferred: list[torch.Tensor]) -> str | None:
    """Why a trace on fake CPU tensors would not give TorchScript's values here, or None."""
    off_cpu = sorted({str(eager_device(t)) for t in deferred if eager_device(t).type != "cpu"})
    if off_cpu:
        return f"its deferred arguments are meant for {', '.join(off_cpu)}, where TorchScript may fuse ops"
    if torch._C._jit_can_fuse_on_cpu():
        return "TorchScript fuses ops on the CPU in this process (torch._C._jit_override_can_fuse_on_cpu)"
    if default_device().type != "cpu":
        return f"factories build on {default_device()} here (a device context), which TorchScript does not see"
    return None


def _deferred_among(args: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The deferred tensors in ``args`` (a tuple of arguments, with lists, tuples, dicts and
    objects of TorchScript classes in it, as TorchScript takes them, and the inner tensors of
    wrapper subclasses; a wrapper that does not say what it holds itself), added to ``found``."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if is_deferred_tensor(a):
                found.append(a)
            elif dispatches_itself(type(a)):  # a wrapper: what it holds where it says, else itself
                if hasattr(a, "__tensor_flatten__"):
                    _deferred_among([getattr(a, name) for name in a.__tensor_flatten__()[0]], found)
                else:
                    found.append(a)
        elif isinstance(a, (list, tuple)):
            _deferred_among(a, found)
        elif isinstance(a, dict):
            _deferred_among(a.values(), found)
        elif _get_script_class(type(a)) is not None:  # an object of a TorchScript class
            _deferred_among(vars(a).values(), found)
    return found


def _bound(schema: Any, args: tuple, kwargs: dict, method: bool) -> list[Any] | None:
    """The arguments as ``schema`` binds them, by position, defaults filled in; None where
    TorchScript would refuse the call (it then raises its own error)."""
    params = schema.arguments[1:] if method else schema.arguments
    if len(args) > len(params) or any(p.kwarg_only for p in params[:len(args)]):
        return None
    named = dict(zip((p.name for p in params), args))
    if set(kwargs) & set(named) or set(kwargs) - {p.name for p in params}:
        return None
    named |= kwargs
    if any(p.name not in named and not p.has_default_value() for p in params):
        return None
    return [named[p.name] if p.name in named else p.default_value for p in params]


def _run_afresh(script: Any, values: list[Any], owner: Any = None) -> Any:
    """The call run op by op, as TorchScript runs a function the first times: once it has run,
    its executor runs an optimized graph, whose differentiable parts compute under
    ``no_grad`` (a trace would keep that); the same ops on the CPU, where nothing is fused. So
    a function of the same graph, new, runs it, unoptimized. ``owner``: the module of a method."""
    fresh = torch._C._create_function_from_graph(script.name, script.inlined_graph)
    with torch.jit.optimized_execution(False):
        return _FUNCTION_CALL(fresh, *values) if owner is None else _FUNCTION_CALL(fresh, owner, *values)


def _capturing() -> Any:
    """The recorder of the constructor or ``fxinit.recording`` being captured on this thread
    (its dispatch mode is on the stack, recording), or None."""
    if torch._C._len_torch_dispatch_stack() == 0:
        return None
    return next((r for mode in _dispatch_modes() if getattr(r := getattr(mode, "recorder", None), "capturing", False)
                 and not r.is_suspended), None)


def _call(original: Callable[..., Any], script: Any, name: str, args: tuple, kwargs: dict) -> Any:
    owner = script.owner if original is _METHOD_CALL else None
    deferred = _deferred_among((args, kwargs), [])
    recorder = next((state_of(t).recorder for t in deferred if is_deferred_tensor(t)), None)
    if (owner is not None or any(dispatches_itself(type(t)) for t in deferred)) and recorder is None:
        recorder = _capturing()  # (a method's module attributes, a wrapper: they may hold the model's tensors)
    if owner is not None and recorder is not None:
        _deferred_among([v for _, v in torch._C._jit_debug_module_iterators(owner)["named_attributes"]], deferred)
    values = _bound(script.schema, args, kwargs, owner is not None) if deferred and recorder is not None else None
    if values is None:  # (no deferred tensor, or a call TorchScript refuses: its own error)
        return original(script, *args, **kwargs)
    reason = _why_not_traced(deferred)
    if reason is None:
        traced = fake_cpu_trace(lambda *v: _run_afresh(script, list(v), owner), tuple(values), {},
                                recorder.suspended)
        if traced is not None:
            with torch._C.DisableTorchFunctionSubclass():  # (TorchScript runs no __torch_function__: plain results)
                return traced()
        asks = reads_the_device(script.inlined_graph)
        if asks is None:
            return original(script, *args, **kwargs)  # (on the meta tensors: nothing in it depends on their device)
        reason = (f"make_fx could not trace it on fake tensors (it reads values, or holds deferred tensors where "
                  f"its arguments do not show them), and {asks} in its graph asks the device")
    raise recorder.fail(
        f"fxinit cannot run the TorchScript function {name} on deferred tensors: TorchScript sees the meta tensors "
        f"underneath, and {reason}", op=f"torch.jit: {name}",
        hint="call it after fxinit.materialize, or run with PYTORCH_JIT=0 (eager construction then runs the Python "
             "function, and so does fxinit)")


def _script_function_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    return _call(_FUNCTION_CALL, self, self.qualified_name, args, kwargs)


def _script_method_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    return _call(_METHOD_CALL, self, f"{self.owner._type().qualified_name()}.{self.name}", args, kwargs)


def send_torchscript_calls_here() -> None:
    """Calls of TorchScript functions and methods reach fxinit (see the module docstring);
    ``capture.doors.open_doors_after_trace`` calls this once, for the process. A call without
    deferred arguments is TorchScript's own."""
    torch.jit.ScriptFunction.__call__ = _script_function_call  # type: ignore[method-assign]
    torch._C.ScriptMethod.__call__ = _script_method_call  # type: ignore[method-assign]
