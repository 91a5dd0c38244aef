"""Spotting calls of opaque init functions from inside them.

``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_`` ask ``tensor.is_meta``
before doing anything else and return early if it is true. transformers keeps its own
references to these function objects, so patching ``torch.nn.init`` would not reach
them; the ``is_meta`` question does. When a deferred tensor is asked ``is_meta`` from
inside one of these functions, capture records the whole call as one node (its
arguments are read off the caller's frame) and answers ``True`` so the function returns.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fxinit.ops import TORCH_FUNCTIONS


@dataclass
class OpaqueCall:
    qualname: str
    tensor: torch.Tensor
    kwargs: dict[str, Any]  # every argument but the tensor, generator included


_REGISTRY: dict[types.CodeType, tuple[str, list[str]]] = {}  # body -> (qualname, parameter names)


def register(qualname: str, fn: Callable) -> None:
    """Calls of ``fn``'s present body are calls of init function ``qualname`` (a body
    ``capture.init_shims`` gave it, as well as torch's own)."""
    _REGISTRY[fn.__code__] = (qualname, list(inspect.signature(fn).parameters))


for _qualname, _fn in TORCH_FUNCTIONS.items():
    register(_qualname, _fn)


def find_opaque_call(frame: types.FrameType | None, tensor: torch.Tensor) -> OpaqueCall | None:
    """The outermost registered init function on the stack that was given ``tensor``."""
    found: OpaqueCall | None = None
    f = frame
    depth = 0
    while f is not None and depth < 12:
        entry = _REGISTRY.get(f.f_code)
        if entry is not None:
            qualname, params = entry
            local = f.f_locals
            if local.get(params[0]) is tensor:
                kwargs = {p: local[p] for p in params[1:] if p in local}
                found = OpaqueCall(qualname, tensor, kwargs)
        f = f.f_back
        depth += 1
    return found
