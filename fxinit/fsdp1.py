"""FSDP1's own deferred-init idiom, unchanged: ``FSDP(fxinit.deferred_init(M), auto_wrap_policy=...)``.

FSDP1's docstring promises that a module made by torchdistX's ``deferred_init`` "will
initialize via ``deferred_init.materialize_module()``". It decides per unit, in
``_need_to_materialize_module``, by asking every parameter and buffer ``is_meta``. A
deferred tensor says ``True`` to torch.distributed, so FSDP would take its meta path
(``to_empty`` + ``reset_parameters()`` per module: fresh values, not eager's). There, and
only when the user gave no ``param_init_fn``, fxinit does what torchdistX's path does: it
materializes the unit (exact values, on the intended device; FSDP then moves them to
``device_id``) and answers ``False``. With a ``param_init_fn`` FSDP calls it as usual.

FSDP1's manual wrapping (``enable_wrap`` + ``wrap`` inside ``__init__``) would flatten
parameters while the constructor is being recorded: refused, pointing to auto-wrapping.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from fxinit.capture.deferred import IS_META_ANSWERS, state_of
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
    if caller.f_locals.get("param_init_fn") is not None:
        return None  # FSDP calls the user's function on a meta-looking module
    materialize(f.f_locals["module"])
    return False


def _register() -> None:
    try:
        from torch.distributed.fsdp import _init_utils
    except ImportError:  # torch built without distributed
        return
    need = _init_utils._need_to_materialize_module.__code__
    init = _init_utils._init_param_handle_from_module.__code__
    codes = [need, *(c for c in need.co_consts if isinstance(c, types.CodeType))]  # its generator expressions

    def answer(frame: types.FrameType, t: torch.Tensor) -> bool | None:
        return _unit_to_materialize(frame, t, need, init)

    IS_META_ANSWERS.update({code: answer for code in codes})


_register()
