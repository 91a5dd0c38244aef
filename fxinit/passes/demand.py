"""Read demand: which elements of each storage a slice's kept values actually depend on.

A rank that owns one shard of a sharded parameter reads only that shard of the full
tensor. Between the random fill of the full tensor and the shard, the layout code copies:
tensor parallelism ``clone``\\ s its chunk (``Shard._shard_tensor``), FSDP2 copies a row
block of that into a padded buffer. Walking the slice backwards from the kept values, the
demand on each storage is carried through those copies position by position, so the fill
learns the rank's own elements (not the TP chunk's), and each copy learns which of its
elements anyone reads: per-rank cost and memory follow the shard, not the model.

The walk keeps, per storage root (``storage_root``), the elements still needed by what
comes later. Going back over a node:

* a whole-storage random fill (``meta["overwrites"]``) needs what is demanded of it, and
  nothing of its target before it;
* a copy (``copy_``, ``clone``, ``_to_copy``) and an element-wise op of inputs of its own
  shape carry the demand on their output to the same positions of their inputs
  (``intervals.carry``); a copy into a view also ends the demand on what it overwrites;
* views and ops that read only metadata read nothing;
* any other op reads all of every input it takes.

``read_demand`` returns, for every whole-storage random fill and every copy, the elements
of its output that are demanded (in storage elements). Anything not understood widens the
demand, never narrows it. Where two storage roots of the graph may share a storage (an op
such as ``set_``), which the capture's storage ids reveal, those roots keep every fill and
copy whole.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import filled_argument, is_view, reads_no_data
from fxinit.passes import intervals
from fxinit.passes.intervals import Set
from fxinit.passes.ranges import Extent, Ranges

aten = torch.ops.aten

#: Out-of-place ops whose element ``i`` is a copy of their input's element ``i``.
COPIES = frozenset({aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default})


@dataclass
class Demand:
    """What the backward walk found: ``fills`` maps each whole-storage random fill to the
    elements of its target's storage read after it, ``copies`` each copy to the elements
    of its output's storage read after it (both sorted disjoint ranges)."""

    fills: dict[fx.Node, Set] = field(default_factory=dict)
    copies: dict[fx.Node, Set] = field(default_factory=dict)


def storage_root(node: fx.Node) -> fx.Node:
    """The node that created ``node``'s storage: up through views and through in-place ops
    (their result is their first argument, ``t_`` and ``copy_`` alike)."""
    while True:
        if is_view(node) or _writes_first_argument(node):
            parent = node.args[0] if node.args else None
            if not isinstance(parent, fx.Node):
                return node
            node = parent
        else:
            return node


def _writes_first_argument(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    ret, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return ret is not None and ret.is_write and first is not None and first.is_write


def read_demand(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node],
                exposed: Mapping[fx.Node, Extent] | None = None) -> Demand:
    """The read demand of the slice ``nodes`` (program order) whose values ``keep`` are
    kept; ``exposed``: kept nodes of which only this storage extent is read."""
    exposed = exposed or {}
    need: dict[fx.Node, Set] = defaultdict(lambda: intervals.EMPTY)
    for k in keep:
        # a kept value needs all of its storage, as eager's does (``torch.save`` writes it,
        # storage views see it); an exposed one only the extent the caller reads
        root = storage_root(k)
        read = intervals.of([exposed[k]]) if k in exposed else intervals.elements(root.meta.get("spec"))[0]
        need[root] = intervals.union(need[root], read)
    found = Demand()
    for n in reversed(nodes):
        _step(n, need, found)
    entangled = _shared_roots(nodes)
    found.fills = {n: s for n, s in found.fills.items() if storage_root(_written(n)) not in entangled}
    found.copies = {n: s for n, s in found.copies.items() if storage_root(n) not in entangled}
    return found


def _step(n: fx.Node, need: dict[fx.Node, Set], found: Demand) -> None:
    """Move ``need`` from after ``n`` to before it (see the module doc)."""
    if n.op == "call_function" and is_view(n):
        return  # reads nothing
    if n.op != "call_function" or reads_no_data(n):
        need.pop(n, None)  # a constant or an allocation: its storage did not exist before
        return
    if n.meta.get("generators"):
        filled = _written(n)
        if n.meta.get("overwrites") and filled is not None:
            root = storage_root(filled)
            covered, exact = intervals.elements(filled.meta.get("spec"))
            found.fills[n] = intervals.intersect(need[root], covered)
            if exact:
                need[root] = intervals.subtract(need[root], covered)
            _read_all(n, need, skip=filled)
        else:
            _read_all(n, need)
            need.pop(n, None)
        return
    target = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if n.target is aten.copy_.default and target is not None and isinstance(n.args[1], fx.Node):
        root = storage_root(target)
        dst = target.meta.get("spec")
        covered, exact = intervals.elements(dst)
        demanded = intervals.intersect(need[root], covered)
        found.copies[n] = demanded
        if exact:
            need[root] = intervals.subtract(need[root], covered)
        _read(n.args[1], intervals.carry(demanded, dst, n.args[1].meta.get("spec")), need)
        return
    if n.target in COPIES and target is not None:
        demanded = intervals.intersect(need.pop(n, intervals.EMPTY), intervals.elements(n.meta.get("spec"))[0])
        found.copies[n] = demanded
        _read(target, intervals.carry(demanded, n.meta.get("spec"), target.meta.get("spec")), need)
        return
    if _pointwise(n):
        written = target if _writes_first_argument(n) else n
        out = written.meta.get("spec")
        demanded = intervals.intersect(need[storage_root(written)], intervals.elements(out)[0])
        if written is n:
            need.pop(n, None)
        for x in n.all_input_nodes:
            if x is written:
                continue  # in place: the positions it writes are the positions it reads
            _read(x, intervals.carry(demanded, out, x.meta.get("spec")), need)
        return
    _read_all(n, need)
    if not _writes_first_argument(n):
        need.pop(n, None)


def _written(n: fx.Node) -> fx.Node | None:
    """The tensor argument ``n`` writes in place (``ops.filled_argument``), or None."""
    index = filled_argument(n)
    arg = n.args[index] if index is not None and len(n.args) > index else None
    return arg if isinstance(arg, fx.Node) else None


def _pointwise(n: fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return torch.Tag.pointwise in tags and n.meta.get("spec") is not None


def _read(x: fx.Node, elements: Set | None, need: dict[fx.Node, Set]) -> None:
    """``x``'s storage is read at ``elements`` (None: all of ``x``)."""
    if elements is None:
        elements = intervals.elements(x.meta.get("spec"))[0] if x.meta.get("spec") is not None else intervals.EVERYTHING
    root = storage_root(x)
    need[root] = intervals.union(need[root], elements)


def _read_all(n: fx.Node, need: dict[fx.Node, Set], skip: fx.Node | None = None) -> None:
    for x in n.all_input_nodes:
        if x is not skip:
            _read(x, None, need)


def _shared_roots(nodes: Sequence[fx.Node]) -> set[fx.Node]:
    """Storage roots that may share their storage with another root: the capture's storage
    ids (``meta["reads"]``, ``meta["mutates"]``) of nodes reading one root disagree."""
    ids: dict[fx.Node, set[Any]] = defaultdict(set)
    for n in nodes:
        roots = {storage_root(x) for x in n.all_input_nodes}
        sids = set(n.meta.get("reads", ())) | set(n.meta.get("mutates", ()))
        if len(roots) == 1 and len(sids) == 1:
            ids[next(iter(roots))] |= sids
    by_id: dict[Any, set[fx.Node]] = defaultdict(set)
    for root, sids in ids.items():
        for sid in sids:
            by_id[sid].add(root)
    shared = {root for roots in by_id.values() if len(roots) > 1 for root in roots}
    return shared | {root for root, sids in ids.items() if len(sids) > 1}


def partial_fills(demand: Demand) -> dict[fx.Node, Ranges]:
    """``{random node: ranges}`` for whole-storage random fills of which only part is read
    later (the ranges of its target's storage that are)."""
    out: dict[fx.Node, Ranges] = {}
    for n, demanded in demand.fills.items():
        spec = _written(n).meta.get("spec")
        if spec is not None and spec.storage_offset == 0 and _strict_part(demanded, spec):
            out[n] = intervals.as_list(demanded)
    return out


#: Copies of fewer elements than this run whole: piecewise copying would not pay.
PARTIAL_COPY_MIN = 1 << 16


def partial_copies(demand: Demand) -> dict[fx.Node, Ranges]:
    """``{copy: ranges}`` for copies (``copy_``, ``clone``, ``_to_copy``) of which only part
    is read later: the ranges of their output's storage that are."""
    out: dict[fx.Node, Ranges] = {}
    for n, demanded in demand.copies.items():
        spec = (n.args[0] if n.target is aten.copy_.default else n).meta.get("spec")
        if spec is not None and spec.numel >= PARTIAL_COPY_MIN and _strict_part(demanded, spec):
            out[n] = intervals.as_list(demanded)
    return out


def _strict_part(demanded: Set, spec) -> bool:  # noqa: ANN001
    """``demanded`` is some, but not all, of the elements ``spec`` covers, and those are known."""
    covered, exact = intervals.elements(spec)
    return exact and intervals.size(demanded) > 0 and intervals.size(intervals.subtract(covered, demanded)) > 0
