"""Slicing: the nodes a set of requested tensors actually needs.

Init graphs are imperative: ops write in place through views, so a value depends not
only on the node that produced it but on every earlier write to its storage. Each node
records the storage ids it read and wrote (``reads``/``mutates``); reading a storage at
program position ``p`` needs all writes to that storage before ``p``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from typing import AbstractSet, Iterable, Sequence

import torch.fx as fx

_END = float("inf")


def required_nodes(nodes: Sequence[fx.Node], targets: Iterable[tuple[fx.Node, int]],
                   dead: AbstractSet[fx.Node] = frozenset()) -> list[fx.Node]:
    """Nodes (in program order) needed for the final values of ``targets``.

    ``targets`` are ``(value node, storage id)`` pairs; the storage id is the one the
    tensor has *now*, which differs from its node's if ``.data =`` or ``set_`` rebound it.
    ``dead`` writes (see ``dead_init``) are never needed.
    """
    writer_pos: dict[int, list[int]] = defaultdict(list)
    writer_node: dict[int, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        if n in dead:
            continue
        for sid in n.meta.get("mutates", ()):
            writer_pos[sid].append(n.meta["pos"])
            writer_node[sid].append(n)
    done_upto: dict[int, int] = defaultdict(int)
    needed: set[fx.Node] = set()
    stack: list[fx.Node] = []

    def need(n: fx.Node) -> None:
        if n not in needed:
            needed.add(n)
            stack.append(n)

    def need_writes(sid: int, before: float) -> None:
        k = len(writer_pos[sid]) if before is _END else bisect_left(writer_pos[sid], before)
        start = done_upto[sid]
        if k > start:
            for w in writer_node[sid][start:k]:
                need(w)
            done_upto[sid] = k

    for node, sid in targets:
        need(node)
        need_writes(sid, _END)
    while stack:
        n = stack.pop()
        for inp in n.all_input_nodes:
            need(inp)
        pos = n.meta.get("pos", 0)
        for sid in n.meta.get("reads", ()):
            need_writes(sid, pos)
        for sid in n.meta.get("mutates", ()):
            need_writes(sid, pos)
    return sorted(needed, key=lambda n: n.meta["pos"])
