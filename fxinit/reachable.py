"""What a module reaches besides its parameters and buffers: tensor attributes and tensors in
list, tuple and dict attributes (anchor tables, caches), and which of those are plain meta
tensors fxinit never recorded. Materialize fills and checks all of them; ``init_graph``
refuses a model that holds the latter."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from fxinit.capture.deferred import MATERIALIZED, is_deferred_tensor

CONTAINERS = (list, tuple, dict)
MODULE_DICTS = {"_parameters", "_buffers", "_modules"}


def contained(x: Any, key: str = "", depth: int = 0) -> Iterable[tuple[str, Any]]:
    """``(path, leaf)`` of nested lists, tuples and dicts (a few levels: anchors, caches)."""
    items = x.items() if type(x) is dict else enumerate(x)
    for k, v in items:
        path = f"{key}[{k!r}]"
        if type(v) in CONTAINERS and depth < 3:
            yield from contained(v, path, depth + 1)
        else:
            yield path, v


def module_slots(mod: torch.nn.Module) -> Iterator[tuple[str, str, Any]]:
    """``(kind, name, value)`` for what one module holds: its parameters and buffers
    (``"_parameters"``, ``"_buffers"``), its other attributes (``"__dict__"``) and the leaves of
    its list, tuple and dict attributes (``"container"``, named like ``anchors[0]``)."""
    for kind in ("_parameters", "_buffers"):
        for name, t in getattr(mod, kind).items():
            yield kind, name, t
    for name, v in vars(mod).items():
        if name in MODULE_DICTS:
            continue
        if type(v) in CONTAINERS:
            for key, x in contained(v):
                yield "container", name + key, x
        else:
            yield "__dict__", name, v


def left_behind(module: torch.nn.Module) -> list[str]:
    """Plain meta tensors that fxinit did not record (built after the trace by torch's own
    code on a deferred tensor's ``device``, or by ``to_empty(device='meta')``) reachable from
    ``module``: materialize cannot give them values, and eager construction would have made
    them real. Tensors materialize made meta (model code built them there) do not count."""
    found = []
    for path, mod in module.named_modules():
        prefix = f"{path}." if path else ""
        for _, name, t in module_slots(mod):
            t = getattr(t, "_local_tensor", t)  # a DTensor's local part
            if isinstance(t, torch.Tensor) and not is_deferred_tensor(t) and t.device.type == "meta" \
                    and MATERIALIZED not in t.__dict__:
                found.append(prefix + name)
    return list(dict.fromkeys(found))
