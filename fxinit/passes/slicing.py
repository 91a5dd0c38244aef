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

from fxinit.ops import reads_no_data

_END = float("inf")


def metadata_only(n: fx.Node) -> bool:
    """``n`` reads nothing but the spec of its inputs, and the graph knows those specs."""
    return reads_no_data(n) and all(i.meta.get("spec") is not None for i in n.all_input_nodes)


def required_nodes(nodes: Sequence[fx.Node], targets: Iterable[tuple[fx.Node, int]],
                   dead: AbstractSet[fx.Node] = frozenset(), to_run: bool = False) -> list[fx.Node]:
    """Nodes (in program order) needed for the final values of ``targets``.

    ``targets`` are ``(value node, storage id)`` pairs; the storage id is the one the
    tensor has *now*, which differs from its node's if ``.data =`` or ``set_`` rebound it.
    ``dead`` writes (see ``dead_init``) are never needed. ``to_run``: the slice is for the
    backend, which stands in for the inputs of ``metadata_only`` nodes with their specs, so
    those inputs are left out (a self-contained graph keeps them).
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
        if to_run and metadata_only(n):  # ``empty_like(x)`` needs x's spec, which the graph has, not its value
            continue
        for inp in n.all_input_nodes:
            need(inp)
        pos = n.meta.get("pos", 0)
        for sid in n.meta.get("reads", ()):
            need_writes(sid, pos)
        for sid in n.meta.get("mutates", ()):
            need_writes(sid, pos)
    return sorted(needed, key=lambda n: n.meta["pos"])
