"""Slicing: the nodes a set of requested tensors actually needs.

Init graphs are imperative: ops write in place through views, so a value depends not
only on the node that produced it but on every earlier write to its storage. Each node
records the storage ids it read and wrote (``reads``/``mutates``); reading a storage at
program position ``p`` needs all writes to that storage before ``p``.

A ``Slicer`` indexes the writers of every storage once per state of a graph, so that the
many slices of one graph (a model materialized layer by layer, an export piece by piece)
each cost only what they contain. Measured on the 405B Llama's graph (3 171 nodes), this
walk beats networkx (a dependency ``DiGraph``, storage-aware through per-storage write
chains, then ``bfs_layers``): building the index takes 0.8 ms against 16 ms for the
``DiGraph``, and a slice of every output 4 ms against 16 ms (dead writes filtered by a
view), one layer 0.03 ms against 0.14 ms.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from typing import AbstractSet, Iterable, Sequence

import torch.fx as fx

from fxinit.ops import reads_no_data

_END = float("inf")

Target = tuple[fx.Node, int]  # (value node, storage id)


def metadata_only(n: fx.Node) -> bool:
    """``n`` reads nothing but the spec of its inputs, and the graph knows those specs."""
    return reads_no_data(n) and all(i.meta.get("spec") is not None for i in n._input_nodes)


class Slicer:
    """Slices of the graph ``nodes`` (program order) without the ``dead`` writes."""

    def __init__(self, nodes: Sequence[fx.Node], dead: AbstractSet[fx.Node] = frozenset()) -> None:
        self.dead = dead
        self._positions: dict[int, list[int]] = defaultdict(list)  # storage -> its writers' positions
        self._writers: dict[int, list[fx.Node]] = defaultdict(list)  # storage -> its writers, dead ones too
        for n in nodes:
            for sid in n.meta.get("mutates", ()):
                self._positions[sid].append(n.meta["pos"])
                self._writers[sid].append(n)

    def required(self, targets: Iterable[Target], to_run: bool = False) -> tuple[list[fx.Node], list[fx.Node]]:
        """The nodes (in program order) needed for the final values of ``targets``, and the
        dead writes they would have needed (skipped).

        ``targets`` are ``(value node, storage id)`` pairs; the storage id is the one the
        tensor has *now*, which differs from its node's if ``.data =`` or ``set_`` rebound it.
        ``to_run``: the slice is for the interpreter, which stands in for the inputs of
        ``metadata_only`` nodes with their specs, so those inputs are left out (a
        self-contained graph keeps them).
        """
        done_upto: dict[int, int] = defaultdict(int)
        needed: set[fx.Node] = set()
        skipped: set[fx.Node] = set()
        stack: list[fx.Node] = []
        dead = self.dead

        def need(n: fx.Node) -> None:
            if n not in needed:
                needed.add(n)
                stack.append(n)

        def need_writes(sid: int, before: float) -> None:
            positions = self._positions.get(sid)
            if not positions:
                return
            k = len(positions) if before is _END else bisect_left(positions, before)
            start = done_upto[sid]
            if k > start:
                for w in self._writers[sid][start:k]:
                    if w in dead:
                        skipped.add(w)
                    else:
                        need(w)
                done_upto[sid] = k

        for node, sid in targets:
            need(node)
            need_writes(sid, _END)
        while stack:
            n = stack.pop()
            if to_run and metadata_only(n):  # ``empty_like(x)`` needs x's spec, which the graph has, not its value
                continue
            for inp in n._input_nodes:
                need(inp)
            pos = n.meta.get("pos", 0)
            for sid in n.meta.get("reads", ()):
                need_writes(sid, pos)
            for sid in n.meta.get("mutates", ()):
                need_writes(sid, pos)
        order = sorted(needed, key=lambda n: n.meta["pos"])
        return order, sorted(skipped - needed, key=lambda n: n.meta["pos"])


def required_nodes(nodes: Sequence[fx.Node], targets: Iterable[Target], dead: AbstractSet[fx.Node] = frozenset(),
                   to_run: bool = False) -> list[fx.Node]:
    """The slice of ``nodes`` that ``targets`` need (``Slicer.required``), indexed once."""
    return Slicer(nodes, dead).required(targets, to_run)[0]
