"""Read ranges: which elements of a randomly filled tensor a slice actually reads.

A rank that owns one shard of a sharded parameter reads only that shard's rows of the
full tensor (FSDP2 splits it and copies its chunk out). If the random op that fills the
tensor fills only the elements that are read, the rest of the allocation is never touched
(so never resident) and never computed: per-rank cost follows the shard, not the model.

``partial_fills(nodes, keep)`` maps each random node that can be restricted to the
half-open element range ``(lo, hi)`` of its target that later nodes read. Anything the
analysis does not understand (a kept alias, a reader without a spec, a non-contiguous
target) leaves the node out, i.e. filled whole.
"""

from __future__ import annotations

from typing import AbstractSet, Sequence

import torch.fx as fx

from fxinit.passes.walk import is_view, reads_no_data, users_of, view_closure


def _extent(spec) -> tuple[int, int] | None:
    if spec is None:
        return None
    if any(s == 0 for s in spec.shape):
        return (spec.storage_offset, spec.storage_offset)
    if any(st < 0 for st in spec.stride):
        return None
    last = spec.storage_offset + sum((s - 1) * st for s, st in zip(spec.shape, spec.stride))
    return (spec.storage_offset, last + 1)


def partial_fills(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node]) -> dict[fx.Node, tuple[int, int]]:
    """``{random node: (lo, hi)}`` for random ops whose target is only partly read."""
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
        lo, hi, ok = numel, 0, True
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
