"""The few graph ops of an InitGraph that are not aten ops.

An InitGraph is a torch.fx graph whose ``call_function`` nodes call aten overloads,
``operator.getitem`` and the functions here. Keeping this vocabulary small and named
is what lets a graph be checked, saved and replayed without the model's code.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch

# Init functions that cannot be expressed as a static aten graph (data-dependent
# sampling, QR, randperm loops) or that return early on meta tensors. They are
# recorded as one node and replayed by calling the installed torch's own function.
OPAQUE_INIT_FUNCTIONS: tuple[str, ...] = (
    "torch.nn.init.trunc_normal_",
    "torch.nn.init._no_grad_trunc_normal_",
    "torch.nn.init.orthogonal_",
    "torch.nn.init.dirac_",
    "torch.nn.init.sparse_",
)


def resolve_init_function(qualname: str) -> Callable[..., Any]:
    """The function object an opaque node names; only the allowed set resolves."""
    if qualname not in OPAQUE_INIT_FUNCTIONS:
        raise ValueError(f"{qualname!r} is not an init function fxinit may call")
    module_name, _, attr = qualname.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def call_init_function(qualname: str, tensor: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Graph op: run an opaque init function in place on ``tensor``.

    The backend sets up the generators (the snapshots recorded at capture) around it.
    """
    resolve_init_function(qualname)(tensor, **kwargs)
    return tensor


call_init_function.__module__ = "fxinit.ops"


@functools.lru_cache(maxsize=None)
def changes_view(target: Any) -> bool:
    """In-place view ops (``t_``, ``unsqueeze_``, ``as_strided_``...): the tensor object they
    are given becomes another view of its storage. A graph gives the result its own node,
    and replay runs the op on an alias (``replay_args``), so that values taken before keep
    their view."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.inplace_view in target.tags


def replay_args(target: Any, args: tuple) -> tuple:
    """The arguments to run graph op ``target`` with when replaying it: ``args``, except that
    an in-place view op gets an alias of its input instead of the input's own value."""
    if changes_view(target) and args and isinstance(args[0], torch.Tensor):
        return (torch.ops.aten.alias.default(args[0]), *args[1:])
    return args


#: Factories whose result holds whatever the memory held (``torch.empty`` & co.).
ALLOCATIONS = frozenset({
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
})


@functools.lru_cache(maxsize=None)
def is_view(target: Any) -> bool:
    """Ops whose result is a view of their first argument (``view``, ``t``, ``slice``, ``detach``...)."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write
