"""Read ranges: which elements of a randomly filled tensor a slice actually reads.

A rank that owns one shard of a sharded parameter reads only that shard's rows of the
full tensor (FSDP2 splits it and copies its chunk out). If the random op that fills the
tensor fills only the elements that are read, the rest of the allocation is never touched
(so never resident) and never computed: per-rank cost follows the shard, not the model.

``partial_fills(nodes, keep)`` maps each random node that can be restricted to the
half-open element range ``(lo, hi)`` of its target that later nodes read. Anything the
analysis does not understand (a kept alias, a reader without a spec, a non-contiguous
target) leaves the node out, i.e. filled whole.

A caller that reads only part of a kept value (rows ``start .. stop`` of a tensor too
large to hold whole, see ``InitGraph.materialize(rows=...)``) says so with ``exposed``:
the kept value then counts as a reader of that extent only, and ``written_elements``
tells how much of a storage such a run still writes (to decide whether computing a
tensor in pieces costs in proportion to the pieces).
"""

from __future__ import annotations

from typing import AbstractSet, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import ALLOCATIONS
from fxinit.passes.walk import is_view, users_of, view_closure

aten = torch.ops.aten

# Ops that read only the shape, dtype and device of their tensor argument.
_METADATA_ONLY = {aten.new_zeros, aten.new_empty, aten.new_ones, aten.new_full, aten.new_empty_strided,
                  aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like}


def reads_no_data(n: fx.Node) -> bool:
    return getattr(n.target, "overloadpacket", None) in _METADATA_ONLY


Extent = tuple[int, int]  # half-open range of storage elements


def _extent(spec) -> Extent | None:
    if spec is None:
        return None
    if any(s == 0 for s in spec.shape):
        return (spec.storage_offset, spec.storage_offset)
    if any(st < 0 for st in spec.stride):
        return None
    last = spec.storage_offset + sum((s - 1) * st for s, st in zip(spec.shape, spec.stride))
    return (spec.storage_offset, last + 1)


def rows_extent(spec, start: int, stop: int) -> Extent | None:
    """The storage elements that rows ``start .. stop`` (of dimension 0) of a tensor of
    ``spec`` span, or None for a layout this analysis does not follow."""
    if spec is None or not spec.shape:
        return None
    rows = spec._replace(shape=(stop - start, *spec.shape[1:]),
                         storage_offset=spec.storage_offset + start * spec.stride[0])
    return _extent(rows)


def partial_fills(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node],
                  exposed: Mapping[fx.Node, Extent] | None = None) -> dict[fx.Node, Extent]:
    """``{random node: (lo, hi)}`` for random ops whose target is only partly read.

    ``exposed``: kept nodes of which the caller reads only this storage extent."""
    exposed = exposed or {}
    users = users_of(nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out: dict[fx.Node, tuple[int, int]] = {}
    for r in nodes:
        if not r.meta.get("rng") or not r.meta.get("overwrites") or not r.args or not isinstance(r.args[0], fx.Node):
            continue
        target = r.args[0]
        spec = target.meta.get("spec")
        if spec is None or spec.storage_offset != 0:
            continue
        numel = spec.numel
        # every node whose value aliases the target's storage: its root and view descendants
        root = target
        while is_view(root) and root.args and isinstance(root.args[0], fx.Node):
            root = root.args[0]
        aliases = view_closure(root, users)
        kept = aliases & keep
        if any(k not in exposed for k in kept):
            continue
        lo, hi, ok = numel, 0, True
        for k in kept:
            lo, hi = min(lo, exposed[k][0]), max(hi, exposed[k][1])
        for a in aliases:
            for u in users[a]:
                if u is r or is_view(u) or reads_no_data(u) or pos.get(u, -1) < pos[r]:
                    continue
                ext = _extent(a.meta.get("spec"))
                if ext is None:
                    ok = False
                    break
                lo, hi = min(lo, ext[0]), max(hi, ext[1])
            if not ok:
                break
        if ok and (lo, hi) != (0, numel) and hi > lo:
            out[r] = (lo, hi)
    return out


def written_elements(nodes: Sequence[fx.Node], value: fx.Node, storage: int,
                     restricted: Mapping[fx.Node, Extent]) -> int:
    """How many elements of ``storage`` (``value``'s) running ``nodes`` writes: random
    fills in ``restricted`` count their range, other in-place writes the whole tensor they
    write, and the allocation of ``value``'s storage its size unless it leaves the memory
    unwritten (``torch.empty``)."""
    root = value
    while is_view(root) and root.args and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    total = 0 if root.target in ALLOCATIONS else _numel(root)
    for n in nodes:
        if storage not in n.meta.get("mutates", ()):
            continue
        if n in restricted:
            total += restricted[n][1] - restricted[n][0]
        else:
            written = next((a for a in n.args if isinstance(a, fx.Node)), None)
            total += _numel(written) if written is not None else 0
    return total


def _numel(n: fx.Node) -> int:
    spec = n.meta.get("spec")
    return 0 if spec is None else spec.numel
