"""The ``is_meta`` question for torch's opaque init functions that do not ask it (torch 2.11).

``capture.opaque`` records a call of ``trunc_normal_``, ``orthogonal_``, ``dirac_`` or
``sparse_`` as one node when the function asks its deferred tensor ``is_meta``. torch asks
since 2.12 (pytorch#176240, #176614). Before that, capture saw what the function does op by
op: exact values stay eager's, but the portable mode draws no ``trunc_normal_`` of its own
(on an H100 with torch 2.11, a float32 ``trunc_normal_`` tensor was torch's ``erfinv_`` of
portable uniforms, 2 units in the last place from the CPU's).

For each such function, ``install()`` gives the function object itself a new body that asks
the question first when its tensor is deferred and otherwise calls the original body
unchanged. The object is changed rather than the module attribute, so the references other
code keeps reach it too (transformers' ``TORCH_INIT_FUNCTIONS``). A real tensor, meta ones
included, runs torch's own code as before; so does a tensor for a device this process lacks
(a CUDA model traced on a CPU machine), recorded op by op as before.

>>> from fxinit.capture.init_shims import install, shimmed
>>> install()
>>> import torch.nn.init
>>> all(torch.nn.init.trunc_normal_.__code__ is code for q, code in shimmed().items() if q.endswith(".trunc_normal_"))
True
"""

from __future__ import annotations

import inspect
import threading
import types

from fxinit.capture.deferred import is_deferred_tensor
from fxinit.capture.devices import device_available
from fxinit.capture.opaque import register
from fxinit.init_bodies import called, original_name
from fxinit.ops import TORCH_FUNCTIONS

_LOCK = threading.Lock()
_SHIMS: dict[str, types.CodeType] = {}  # qualname -> the body that asks ``is_meta`` first
_installed = False


def _recordable(t: object) -> bool:
    """A deferred tensor, or a deferred DTensor (whose local tensor is deferred), on a device
    this process has. For a device it lacks, capture could not tell how far a whole call moves
    the device's generator (torch 2.12 on refuses it); op by op, it can."""
    if not (is_deferred_tensor(t) or is_deferred_tensor(getattr(t, "_local_tensor", None))):
        return False
    device = t.device  # type: ignore[attr-defined]
    return device.type in ("cpu", "meta") or device_available(device)


def _asks(qualname: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether init function ``qualname``, or a registered one it calls, asks ``is_meta``."""
    fn = TORCH_FUNCTIONS[qualname]
    return "is_meta" in fn.__code__.co_names or any(
        _asks(q, seen | {qualname}) for q in called(fn, TORCH_FUNCTIONS) if q not in seen)


def _shim_code(fn: types.FunctionType) -> types.CodeType | None:
    """A body for ``fn``'s own function object: ask a deferred first argument ``is_meta``
    (capture answers inside a registered init function), else call a copy of the original.
    None for a signature it cannot repeat (``*args``: no torch version has one)."""
    params = list(inspect.signature(fn).parameters.values())
    if not params or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params):
        return None
    original = original_name(fn)
    fn.__globals__[original] = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                                  fn.__closure__)
    fn.__globals__[original].__kwdefaults__ = fn.__kwdefaults__
    fn.__globals__["__fxinit_recordable__"] = _recordable
    positional = [p.name for p in params if p.kind != p.KEYWORD_ONLY]
    keyword = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    signature = ", ".join(positional + (["*"] + keyword if keyword else []))
    call = ", ".join(positional + [f"{k}={k}" for k in keyword])
    first = params[0].name
    source = (f"def {fn.__name__}({signature}):\n"
              f"    if __fxinit_recordable__({first}) and {first}.is_meta:\n"
              f"        return {first}\n"
              f"    return {original}({call})\n")
    scratch: dict = {}
    exec(compile(source, fn.__code__.co_filename, "exec"), fn.__globals__, scratch)
    names = {"co_qualname": fn.__code__.co_qualname} if hasattr(fn.__code__, "co_qualname") else {}  # Python 3.11+
    return scratch[fn.__name__].__code__.replace(co_name=fn.__code__.co_name, co_firstlineno=fn.__code__.co_firstlineno,
                                                 **names)


def install() -> None:
    """Give each of torch's registered init functions that does not ask ``is_meta`` a body
    that does (once per process; nothing on torch 2.12 and later)."""
    global _installed
    if _installed:
        return
    with _LOCK:
        if _installed:
            return
        need = [q for q in TORCH_FUNCTIONS if not _asks(q)]
        for qualname in need:
            fn = TORCH_FUNCTIONS[qualname]
            code = _shim_code(fn)
            if code is not None:
                _SHIMS[qualname] = fn.__code__ = code
                register(qualname, fn)
        _installed = True


def shimmed() -> dict[str, types.CodeType]:
    """Registered init function -> the body ``install`` gave it (empty before ``install``,
    and on torch versions whose init functions ask ``is_meta`` themselves)."""
    return dict(_SHIMS)
