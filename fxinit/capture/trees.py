"""Walking the arguments and results of aten ops.

Aten arguments and results nest only tuples, lists and dicts (torch.Size is a tuple of
ints, which no mapped function changes): walking them directly costs a fraction of
torch's general pytree, which dominated capture time per op.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# Leaves every mapped function returns unchanged: not worth a call each.
PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def map_tree(fn: Callable[[Any], Any], x: Any) -> Any:
    """``tree_map`` over the containers of aten arguments and results (``fn`` must return
    ints, floats, strings, dtypes, devices, layouts, memory formats and None unchanged)."""
    t = type(x)
    if t is tuple:
        return tuple([v if type(v) in PLAIN else map_tree(fn, v) for v in x])
    if t is list:
        return [v if type(v) in PLAIN else map_tree(fn, v) for v in x]
    if t is dict:
        return {k: v if type(v) in PLAIN else map_tree(fn, v) for k, v in x.items()}
    return fn(x)


def leaves(x: Any, out: list[Any] | None = None) -> list[Any]:
    """``tree_flatten(x)[0]`` for the containers of aten arguments and results."""
    out = [] if out is None else out
    t = type(x)
    if t is tuple or t is list:
        for v in x:
            leaves(v, out)
    elif t is dict:
        for v in x.values():
            leaves(v, out)
    else:
        out.append(x)
    return out


def tensors_in(x: Any) -> list[torch.Tensor]:
    return [t for t in leaves(x) if isinstance(t, torch.Tensor)]
