"""Cast fusion: a random fill that is only ever read through a cast runs chunk by chunk,
each chunk cast into the result as it is produced.

``w = torch.empty(n, m); w.normal_(); w = w.to(torch.bfloat16)`` in ``__init__``, or a
float32 graph materialized with ``dtype=torch.bfloat16``, would hold the full-precision
tensor whole next to its cast. When the full-precision storage is a fresh allocation that
one random op overwrites completely and nothing else reads but the cast, the fill can run
in pieces of ``CHUNK`` elements into a small scratch buffer, each piece cast into the
result: the full-precision tensor never exists, and the bits are those of fill-then-cast
(a cast is element-wise, and the piece sampler reproduces the whole fill's elements).

This pass only finds the candidates; the backend decides per run whether the sampler
can be split exactly (``passes.fills``) and otherwise runs the members unfused.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import ALLOCATIONS
from fxinit.passes.roots import storage_root
from fxinit.passes.walk import users_of, view_closure

aten = torch.ops.aten

_IDENTITY_VIEWS = {aten.detach.default, aten.alias.default}


@dataclass(frozen=True)
class FusedCast:
    """A fill-then-cast that can run in chunks.

    ``alloc`` allocates the full-precision storage, ``fill`` overwrites all of it, and
    ``results`` are the nodes whose value is the cast tensor (the cast node, or the kept
    outputs themselves when the cast is a requested output dtype); ``members`` are all the
    nodes the fused run replaces.
    """

    alloc: fx.Node
    fill: fx.Node
    results: tuple[fx.Node, ...]
    members: frozenset[fx.Node]
    dtype: torch.dtype


def fused_casts(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node],
                output_dtype: torch.dtype | None = None, min_numel: int = 0) -> dict[fx.Node, FusedCast]:
    """``{fill node: FusedCast}`` for the slice ``nodes`` (program order).

    ``output_dtype``: the floating-point dtype the kept outputs are requested in
    (``materialize(dtype=...)``); a kept full-precision tensor is then a cast too.
    ``min_numel``: nothing at all where no fill of the slice has this many elements (the
    caller keeps only fusions of at least that size: a whole-slice shortcut, not a filter).
    """
    if not any(n.meta.get("generators") and n.args and isinstance(n.args[0], fx.Node)
               and (spec := n.args[0].meta.get("spec")) is not None and spec.numel >= min_numel for n in nodes):
        return {}
    users = users_of(nodes)
    touching: dict[int, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        for sid in {*n.meta.get("reads", ()), *n.meta.get("mutates", ())}:
            touching[sid].append(n)
    plans: dict[fx.Node, FusedCast] = {}
    for fill in nodes:
        plan = _plan(fill, users, touching, keep, output_dtype)
        if plan is not None:
            plans[fill] = plan
    return plans


def _plan(fill: fx.Node, users: dict[fx.Node, list[fx.Node]], touching: dict[int, list[fx.Node]],
          keep: AbstractSet[fx.Node], output_dtype: torch.dtype | None) -> FusedCast | None:
    if not fill.meta.get("generators") or not fill.args or not isinstance(fill.args[0], fx.Node):
        return None
    mutated = tuple(fill.meta.get("mutates", ()))
    if len(mutated) != 1 or tuple(fill.meta.get("overwrites", ())) != mutated:
        return None
    if any(isinstance(a, fx.Node) for a in (*fill.args[1:], *fill.kwargs.values())) or users[fill]:
        return None
    alloc = fill.args[0]
    while alloc.target in _IDENTITY_VIEWS:
        alloc = alloc.args[0]
    spec = alloc.meta.get("spec")
    if alloc.target not in ALLOCATIONS or not _plain(spec) or any(isinstance(a, fx.Node) for a in alloc.args):
        return None
    aliases = view_closure(alloc, users, lambda u: u.target in _IDENTITY_VIEWS and u.meta.get("spec") == spec)
    views = sorted(aliases - {alloc}, key=lambda v: v.meta["pos"])
    casts = [u for a in aliases for u in users[a] if u is not fill and u.target not in _IDENTITY_VIEWS]
    others = set(touching[mutated[0]]) - aliases - {fill} - set(casts)
    if others or any(u not in aliases and u is not fill and u not in casts for a in aliases for u in users[a]):
        return None
    kept = [a for a in (alloc, *views) if a in keep]
    pos = fill.meta["pos"]
    if any(c.meta["pos"] < pos for c in casts) or any(v.meta["pos"] > pos and v not in kept for v in views):
        return None
    if len(casts) == 1 and not kept:
        cast = casts[0]
        dtype = _cast_dtype(cast, spec)
        if dtype is None:
            return None
        if cast in keep and output_dtype is not None and output_dtype != dtype:
            return None  # the kept cast would be cast again
        return FusedCast(alloc, fill, (cast,), frozenset({alloc, *views, fill, cast}), dtype)
    if not casts and kept and output_dtype is not None and output_dtype != spec.dtype and spec.dtype.is_floating_point:
        return FusedCast(alloc, fill, tuple(kept), frozenset({alloc, *views, fill}), output_dtype)
    return None


def _plain(spec) -> bool:
    """A contiguous CPU tensor at the start of its storage."""
    if spec is None or spec.storage_offset != 0 or spec.device.type != "cpu":
        return False
    expected = 1
    for size, stride in zip(reversed(spec.shape), reversed(spec.stride)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _cast_dtype(cast: fx.Node, spec) -> torch.dtype | None:
    """The dtype of a plain same-device dtype cast of ``spec``'s tensor, else None."""
    if cast.target is not aten._to_copy.default or len(cast.args) != 1:
        return None
    allowed = {"dtype", "device", "layout", "pin_memory", "memory_format"}
    if set(cast.kwargs) - allowed or cast.kwargs.get("memory_format") not in (None, torch.preserve_format,
                                                                               torch.contiguous_format):
        return None
    out = cast.meta.get("spec")
    if out is None or out.shape != spec.shape or out.stride != spec.stride or out.device != spec.device:
        return None
    if not (out.dtype.is_floating_point and spec.dtype.is_floating_point) or out.dtype == spec.dtype:
        return None
    return out.dtype


def cast_points(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node],
                shared: Mapping[fx.Node, tuple[fx.Node, bool]] = {}) -> dict[fx.Node, list[fx.Node]]:
    """``{node: kept nodes}``: once ``node`` ran, nothing later in the slice reads or writes
    those kept values (through any alias, or reuses them through the CSE map ``shared``),
    so a requested output dtype can be applied there and the full-precision value freed,
    instead of at the end of the run."""
    index = {n: i for i, n in enumerate(nodes)}
    users = users_of(nodes)
    last_touch: dict[int, int] = {}
    root_touch: dict[fx.Node, int] = {}  # by storage root too: a split's piece records no storage id
    for i, n in enumerate(nodes):
        if n in shared:
            users[shared[n][0]].append(n)
        for sid in {*n.meta.get("reads", ()), *n.meta.get("mutates", ())}:
            last_touch[sid] = i
        for x in (n, *n._input_nodes):
            root_touch[storage_root(x)] = i
    points: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for k in nodes:
        if k not in keep:
            continue
        closure = view_closure(k, users)
        last = max(index[u] for c in closure for u in (c, *users.get(c, ())))
        for c in closure:
            for sid in {*c.meta.get("reads", ()), *c.meta.get("mutates", ())}:
                last = max(last, last_touch[sid])
            last = max(last, root_touch.get(storage_root(c), last))
        points[nodes[last]].append(k)
    return dict(points)
