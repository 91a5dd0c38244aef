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
"""

from __future__ import annotations

from typing import AbstractSet, Sequence

import torch.fx as fx

from fxinit.passes.walk import is_view, reads_no_data, users_of, view_closure


Ranges = list[tuple[int, int]]
#: Above this many runs a view is taken as its whole extent (a column of a matrix...).
MAX_RUNS = 1 << 14


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
        last = spec.storage_offset + sum((n - 1) * st for n, st in dims)
        return [(spec.storage_offset, last + 1)]
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


def partial_fills(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node]) -> dict[fx.Node, Ranges]:
    """``{random node: ranges}`` for random ops whose target is only partly read."""
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
        if aliases & keep:
            continue
        read: Ranges = []
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
