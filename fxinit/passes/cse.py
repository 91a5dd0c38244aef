"""Common subexpressions: a deterministic computation the slice already did is not redone.

Models compute the same constant tensor again and again: every layer's rotary
``inv_freq = 1 / base ** (arange(0, d, 2) / d)``, every attention block's causal mask
``tril(ones(n, n))``. Replaying the same op on the same inputs gives the same bits
(init ops are deterministic on CPU), so the second computation can reuse the first's
value. It is exact only when neither value is written afterwards and the inputs did
not change in between; a duplicate that is itself an output (or viewed by one) gets a
copy of the first value, so outputs keep storages of their own, as in eager.
"""

from __future__ import annotations

from collections import defaultdict
from typing import AbstractSet, Any, Sequence

import torch
import torch.fx as fx

from fxinit.ops import ALLOCATIONS, per_target
from fxinit.passes.walk import Users, users_of, view_closure



def common_subexpressions(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node]) -> dict[fx.Node, tuple[fx.Node, bool]]:
    """``{duplicate: (first node computing the same value, copy)}`` for the slice ``nodes``
    (program order); ``copy`` says the duplicate needs a storage of its own."""
    users = users_of(nodes)
    writes: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        for sid in n.meta.get("mutates", ()):
            writes[sid].append(n.meta["pos"])
    rep: dict[fx.Node, fx.Node] = {}
    seen: dict[Any, fx.Node] = {}
    out: dict[fx.Node, tuple[fx.Node, bool]] = {}
    for n in nodes:
        key = _key(n, rep)
        if key is None or _written(n, users):
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = n
            continue
        between = (first.meta["pos"], n.meta["pos"])
        if any(between[0] < p < between[1] for sid in n.meta.get("reads", ()) for p in writes[sid]):
            seen[key] = n  # an input changed: later duplicates compare with this one
            continue
        rep[n] = first  # the same bits: ops on either compare equal from here on
        copy = _reaches_output(n, users, keep) or _reaches_output(first, users, keep)
        if copy and not n.all_input_nodes:
            continue  # a factory (zeros, ones, arange) writes its output no slower than a copy would
        out[n] = (first, copy)
    return out


def _key(n: fx.Node, rep: dict[fx.Node, fx.Node]) -> Any:
    """A hashable description of what ``n`` computes, or None if it is not a pure,
    deterministic, allocating op."""
    if n.op == "get_attr":
        return ("get_attr", n.target)
    if n.op != "call_function" or n.meta.get("generators") or n.meta.get("mutates") or n.meta.get("spec") is None:
        return None
    if not _pure(n.target):
        return None
    try:  # the op by identity (an OpOverload hashes in Python; ops are never freed)
        key = (id(n.target), _canonical(n.args, rep), _canonical(tuple(sorted(n.kwargs.items())), rep),
               n.meta.get("default_dtype"), n.meta.get("numerics"))
        hash(key)
    except TypeError:
        return None
    return key


@per_target
def _pure(target: Any) -> bool:
    """An op that allocates its result and writes none of its arguments (not an uninitialized
    allocation: two of those are two different tensors)."""
    schema = getattr(target, "_schema", None)
    if schema is None or target in ALLOCATIONS:
        return False
    return not any(a.alias_info is not None for a in schema.arguments) and \
        not any(r.alias_info is not None for r in schema.returns)


def _canonical(value: Any, rep: dict[fx.Node, fx.Node]) -> Any:
    """Arguments as a hashable value; numbers carry their type (``1``, ``1.0`` and ``True``
    compare equal in Python but are different scalars to an op)."""
    if isinstance(value, fx.Node):
        return ("node", rep.get(value, value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_canonical(v, rep) for v in value))
    if isinstance(value, float):
        return ("float", value.hex()) if value == value else ("float", "nan")
    if isinstance(value, (bool, int, str, complex, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value)
    raise TypeError(f"no canonical form for {type(value).__name__}")


def _written(n: fx.Node, users: Users) -> bool:
    """Whether anything writes ``n``'s value, through it or a view of it."""
    return any(u.meta.get("mutates") for v in view_closure(n, users) for u in users.get(v, ()))


def _reaches_output(n: fx.Node, users: Users, keep: AbstractSet[fx.Node]) -> bool:
    return bool(view_closure(n, users) & keep)
