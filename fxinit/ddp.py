"""``DistributedDataParallel`` of a deferred model: refused by name, before DDP starts.

DDP broadcasts rank 0's parameters and buffers (``init_sync``) and builds its reducer over
the parameters' memory (gradient buckets). Neither exists before ``materialize``: the
broadcast failed in C++ (``Tensor.item() cannot be called on meta tensors``), and with
``init_sync=False`` the reducer kept the deferred objects, which ``materialize`` cannot swap
while it holds them, so the gradients of the materialized model were never averaged across
ranks, silently (found by a Lightning sweep: ``DDPStrategy(init_sync=False)`` with ``setup``
before ``materialize``). Eager's DDP wraps a built model; so does this: materialize first.
FSDP2 (``fully_shard``) and DTensor layouts take a deferred model.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import torch

from fxinit.capture.deferred import is_deferred_tensor
from fxinit.capture.post_import import when_imported
from fxinit.capture.provenance import format_source, user_frame
from fxinit.errors import DeferredInitError


def _first_deferred(module: torch.nn.Module) -> str | None:
    ignored = getattr(module, "_ddp_params_and_buffers_to_ignore", ())
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if name not in ignored and is_deferred_tensor(t):
            return name
    return None


def _register(distributed: types.ModuleType) -> None:
    ddp = distributed.DistributedDataParallel
    wrapped = ddp.__init__

    @functools.wraps(wrapped)
    def __init__(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        name = _first_deferred(module) if isinstance(module, torch.nn.Module) else None
        if name is not None:
            raise DeferredInitError(
                f"DistributedDataParallel of a model with deferred tensors ({name}): DDP broadcasts their values "
                "and keeps their memory in its gradient buckets, and neither exists before materialize",
                op="DistributedDataParallel", source=format_source(user_frame(sys._getframe(1))),
                hint="fxinit.materialize(model) first, then wrap it (a framework's DDP strategy: materialize before "
                     "its setup, e.g. in LightningModule.configure_model); or shard it with fully_shard, which "
                     "takes a deferred model")
        wrapped(self, module, *args, **kwargs)

    ddp.__init__ = __init__


when_imported("torch.nn.parallel.distributed", _register)
