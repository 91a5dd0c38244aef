"""FSDP1's own deferred-init idiom, unchanged: ``FSDP(fxinit.deferred_init(M), auto_wrap_policy=...)``.

FSDP1's docstring promises that a module made by torchdistX's ``deferred_init`` "will
initialize via ``deferred_init.materialize_module()``". It decides per unit, in
``_need_to_materialize_module``, by asking every parameter and buffer ``is_meta``. A
deferred tensor says ``True`` to torch.distributed, so FSDP would take its meta path
(``to_empty`` + ``reset_parameters()`` per module: fresh values, not eager's). There, and
fxinit does what torchdistX's path does: it materializes the unit (exact values, on the
intended device; FSDP then moves them to ``device_id``) and answers ``False``, also where a
``param_init_fn`` is given (a framework's: composer's, or torch's documented ``to_empty`` +
``reset_parameters``), which eager's FSDP never calls on a built model: it failed in FSDP's
device check (``fxinit.materialize_module`` there materializes the unit too), and, with
``fxinit.torchdistx.install()``, FSDP's torchdistX branch ran it on the deferred unit. For a model
traced on the meta device, what eager's FSDP runs on a meta module is recorded on the unit
first: the ``param_init_fn``, or without one its own ``to_empty`` + ``reset_parameters()`` per
module (Lightning's ``FSDPStrategy`` with ``init_module(empty_init=True)``); it failed in
FSDP's device check, or was refused. FSDP's list of the unit's parameters still holds the
objects ``to_empty`` replaced there, deferred: they are taken off it, or its torchdistX branch
(``fake.is_fake``) ran the ``param_init_fn`` a second time, drawing other values, silently.

FSDP1's manual wrapping (``enable_wrap`` + ``wrap`` inside ``__init__``) would flatten
parameters while the constructor is being recorded: refused, pointing to auto-wrapping.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from fxinit.capture.deferred import IS_META_ANSWERS, is_deferred_tensor, state_of
from fxinit.capture.post_import import when_imported
from fxinit.errors import DeferredInitError
from fxinit.materialize import materialize


def _unit_to_materialize(frame: types.FrameType, t: torch.Tensor, need: Any, init: Any) -> bool | None:
    """The answer to ``t.is_meta`` asked in ``_need_to_materialize_module`` (or its generator)."""
    f: types.FrameType | None = frame
    while f is not None and f.f_code is not need:
        f = f.f_back
    caller = f.f_back if f is not None else None
    if f is None or caller is None or caller.f_code is not init:
        return None
    if state_of(t).recorder.capturing:
        raise DeferredInitError(
            "FSDP1 wraps a module inside a constructor that fxinit is recording (enable_wrap/wrap in __init__): "
            "its flat parameters would be built from values that do not exist yet",
            op="FullyShardedDataParallel", hint="build the model with fxinit first, then wrap it: "
                                                "FSDP(model, auto_wrap_policy=...) materializes each unit exactly")
    managed = [p for p in f.f_locals.get("managed_params", ()) if is_deferred_tensor(p)]
    unit = f.f_locals["module"]
    if not any(is_deferred_tensor(x) for x in (*unit.parameters(), *unit.buffers())):
        return False  # done by an earlier answer (FSDP's list still holds the objects to_empty replaced)
    on_meta = any(state_of(t).device.type == "meta" for t in (*managed, t))
    init_fn = caller.f_locals.get("param_init_fn")
    if torchdistx_branch(caller.f_globals) and managed and not on_meta and not callable(init_fn):
        return False  # not meta: FSDP asks fake.is_fake and calls deferred_init.materialize_module (fxinit's),
        # or refuses a param_init_fn that is not callable
    if on_meta:  # what eager's FSDP runs on a meta module, recorded; then the unit is exact
        state, fsdp = caller.f_locals["state"], caller.f_globals
        if init_fn is not None:
            fsdp["_materialize_with_param_init_fn"](unit, init_fn, state._ignored_modules)
        else:  # to_empty + reset_parameters() per module
            fsdp["_materialize_meta_module"](unit, caller.f_locals["device_id"], state._ignored_modules,
                                             state._device_handle)
    materialize(unit)
    listed = f.f_locals.get("managed_params")
    if isinstance(listed, list):  # FSDP asks torchdistX's fake.is_fake of it next: the objects to_empty
        listed[:] = [p for p in listed if not is_deferred_tensor(p)]  # replaced are done, not to initialize again
    return False


def torchdistx_branch(init_utils_globals: dict) -> bool:
    """Whether FSDP1 found fxinit's torchdistX stand-in (``fxinit.torchdistx``): then its own
    torchdistX branch materializes each unit through fxinit."""
    found = init_utils_globals.get("deferred_init")
    return bool(init_utils_globals.get("_TORCHDISTX_AVAIL")) and getattr(found, "fxinit_stand_in", False)


def _register(_init_utils: types.ModuleType) -> None:
    need = _init_utils._need_to_materialize_module.__code__
    init = _init_utils._init_param_handle_from_module.__code__
    codes = [need, *(c for c in need.co_consts if isinstance(c, types.CodeType))]  # its generator expressions

    def answer(frame: types.FrameType, t: torch.Tensor) -> bool | None:
        return _unit_to_materialize(frame, t, need, init)

    IS_META_ANSWERS.update({code: answer for code in codes})


when_imported("torch.distributed.fsdp._init_utils", _register)
