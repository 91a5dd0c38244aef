"""Read ranges: which elements of a randomly filled tensor a slice actually reads.

A rank that owns one shard of a sharded parameter reads only that shard of the full
tensor: rows (FSDP2, column-parallel), a block of every row (row-parallel), rows of two
blocks (FSDP2 over tensor parallel). If the random op that fills the tensor fills only
the elements that are read, the rest of the allocation is never computed (and pages it
never touches are never resident): per-rank cost follows the shard, not the model.

``partial_fills(nodes, keep)`` maps each random node that can be restricted to the
half-open element ranges of its target that later nodes read (sorted, disjoint).
Anything the analysis does not understand (a kept alias, a reader without a spec, a
non-contiguous target) leaves the node out, i.e. filled whole.

A caller that reads only part of a kept value (rows ``start .. stop`` of a tensor too
large to hold whole, see ``InitGraph.materialize(rows=...)``) says so with ``exposed``:
the kept value then counts as a reader of that extent only, and ``written_elements``
tells how much of a storage such a run still writes (to decide whether computing a
tensor in pieces costs in proportion to the pieces).
"""

from __future__ import annotations

from typing import AbstractSet, Mapping, Sequence

import torch.fx as fx

from fxinit.ops import ALLOCATIONS, is_view, reads_no_data, view_base
from fxinit.passes.walk import users_of, view_closure


Extent = tuple[int, int]  # half-open range of storage elements
Ranges = list[Extent]  # sorted, disjoint
#: Above this many runs a view is taken as its whole extent (a column of a matrix...).
MAX_RUNS = 1 << 14


def _extent(spec) -> Extent | None:  # noqa: ANN001
    if spec is None:
        return None
    if any(s == 0 for s in spec.shape):
        return (spec.storage_offset, spec.storage_offset)
    if any(st < 0 for st in spec.stride):
        return None
    last = spec.storage_offset + sum((s - 1) * st for s, st in zip(spec.shape, spec.stride))
    return (spec.storage_offset, last + 1)


def rows_extent(spec, start: int, stop: int) -> Extent | None:  # noqa: ANN001
    """The storage elements that rows ``start .. stop`` (of dimension 0) of a tensor of
    ``spec`` span, or None for a layout this analysis does not follow."""
    if spec is None or not spec.shape:
        return None
    rows = spec._replace(shape=(stop - start, *spec.shape[1:]),
                         storage_offset=spec.storage_offset + start * spec.stride[0])
    return _extent(rows)


def _element_ranges(spec) -> Ranges | None:  # noqa: ANN001
    """The storage elements a strided view covers, as sorted disjoint half-open ranges."""
    if spec is None or any(st < 0 for st in spec.stride):
        return None
    dims = [(n, st) for n, st in zip(spec.shape, spec.stride) if n != 1]
    if any(n == 0 for n, _ in dims):
        return []
    dims.sort(key=lambda d: d[1])  # innermost first; merge dimensions that continue each other
    run, inner = 1, 0
    while inner < len(dims) and dims[inner][1] == run:
        run *= dims[inner][0]
        inner += 1
    outer = dims[inner:]
    count = 1
    for n, _ in outer:
        count *= n
    if count > MAX_RUNS:
        extent = _extent(spec)
        return [extent] if extent is not None else None
    starts = [spec.storage_offset]
    for n, st in outer:
        starts = [s + i * st for s in starts for i in range(n)]
    return _merge([(s, s + run) for s in starts])


def _merge(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out


def partial_fills(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node],
                  exposed: Mapping[fx.Node, Extent] | None = None) -> dict[fx.Node, Ranges]:
    """``{random node: ranges}`` for random ops whose target is only partly read.

    ``exposed``: kept nodes of which the caller reads only this storage extent."""
    exposed = exposed or {}
    users = users_of(nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out: dict[fx.Node, Ranges] = {}
    for r in nodes:
        if not r.meta.get("generators") or not r.meta.get("overwrites") or not r.args or not isinstance(r.args[0], fx.Node):
            continue
        target = r.args[0]
        spec = target.meta.get("spec")
        if spec is None or spec.storage_offset != 0:
            continue
        numel = spec.numel
        # every node whose value aliases the target's storage: its root and view descendants
        aliases = view_closure(view_base(target), users)
        kept = aliases & keep
        if any(k not in exposed for k in kept):
            continue
        read: Ranges = [exposed[k] for k in kept]
        ok = True
        for a in aliases:
            if any(not (u is r or is_view(u) or reads_no_data(u) or pos.get(u, -1) < pos[r]) for u in users[a]):
                covered = _element_ranges(a.meta.get("spec"))
                if covered is None:
                    ok = False
                    break
                read += covered
        read = _merge(read)
        if ok and read and read != [(0, numel)]:
            out[r] = read
    return out


def written_elements(nodes: Sequence[fx.Node], value: fx.Node, storage: int,
                     restricted: Mapping[fx.Node, Ranges]) -> int:
    """How many elements of ``storage`` (``value``'s) running ``nodes`` writes: random
    fills in ``restricted`` count their ranges, other in-place writes the whole tensor they
    write, and the allocation of ``value``'s storage its size unless it leaves the memory
    unwritten (``torch.empty``)."""
    root = view_base(value)
    total = 0 if root.target in ALLOCATIONS else _numel(root)
    for n in nodes:
        if storage not in n.meta.get("mutates", ()):
            continue
        if n in restricted:
            total += sum(hi - lo for lo, hi in restricted[n])
        else:
            written = next((a for a in n.args if isinstance(a, fx.Node)), None)
            total += _numel(written) if written is not None else 0
    return total


def _numel(n: fx.Node) -> int:
    spec = n.meta.get("spec")
    return 0 if spec is None else spec.numel
