"""Independent parts of a slice: groups of nodes that share no value and no storage.

Each group can run on its own thread: every random op carries its own generator
snapshot, so groups do not depend on each other's draws, and results stay exact in
any interleaving.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch.fx as fx


def independent_groups(nodes: Sequence[fx.Node],
                       links: Iterable[tuple[fx.Node, fx.Node]] = ()) -> list[list[fx.Node]]:
    """Partition ``nodes`` (program order) into independent groups, each in program order,
    largest first (a thread pool then finishes the long ones early). ``links`` are extra
    pairs that must share a group (a CSE duplicate and the node whose value it reuses)."""
    parent: dict[object, object] = {}

    def find(x: object) -> object:
        root = x
        while parent.setdefault(root, root) is not root:
            root = parent[root]
        while parent[x] is not root:
            parent[x], x = root, parent[x]
        return root

    def union(a: object, b: object) -> None:
        ra, rb = find(a), find(b)
        if ra is not rb:
            parent[ra] = rb

    members = set(nodes)
    for n in nodes:
        find(n)
        for inp in n._input_nodes:
            if inp in members:
                union(n, inp)
        meta = n.meta
        for sid in (*meta.get("reads", ()), *meta.get("mutates", ())):
            union(n, sid)  # storage ids are ints, never nodes
    for a, b in links:
        union(a, b)
    groups: dict[object, list[fx.Node]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return sorted(groups.values(), key=lambda g: -_cost(g))


def _cost(group: list[fx.Node]) -> int:
    return sum(n.meta["spec"].nbytes for n in group if n.meta.get("spec") is not None)
