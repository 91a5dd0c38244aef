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
* a copy (``copy_``, ``clone``, ``_to_copy``; ``constant_pad_nd`` into the unpadded part of its
  output) and an element-wise op of inputs of its own shape carry the demand on their output
  to the same positions of their inputs (``intervals.carry``); a copy into a view also ends
  the demand on what it overwrites;
  where a copy's demanded elements are a fill's draws (``passes.origins``), the copy draws
  them itself and carries no demand for them (the fill and the copies before it need
  not write them);
* views and ops that read only metadata read nothing;
* any other op reads all of every input it takes, and so does an element-wise op on integer
  values (unread elements could hold a zero it divides by) and anything on a view that
  reinterprets its storage's dtype (``roots.reinterprets``).

``read_demand`` returns, for every whole-storage random fill and every copy, the elements
of its output that are demanded (in storage elements), and the copies' draws. Anything not understood widens the
demand, never narrows it. Where two storage roots of the graph may share a storage (an op
such as ``set_``), which the capture's storage ids reveal, those roots keep every fill and
copy whole.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import AbstractSet, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import constant_value, is_view, reads_no_data
from fxinit.passes import intervals
from fxinit.passes.intervals import Set
from fxinit.passes.origins import Copied, Origins, Runs, copied_views, restrict
from fxinit.passes.ranges import Extent, Ranges
from fxinit.passes.roots import filled, reinterprets, shared_roots, storage_root, writes_first_argument

aten = torch.ops.aten

#: A copy draws the elements it writes itself only where they come in runs at least this
#: long on average: shorter runs cost more to draw (blocks of 16, skips) than to copy.
FORWARD_RUN_MIN = 256


@dataclass
class Demand:
    """What the backward walk found: ``fills`` maps each whole-storage random fill to the
    elements of its target's storage read after it, ``copies`` each copy to the elements
    of its output's storage read after it that it copies (both sorted disjoint ranges),
    ``forwards`` each copy that draws some of them itself to those, as ``origins.Runs``,
    and ``constants`` each factory of a tensor of one value (``zeros``) to the elements of
    it read before anything overwrites them."""

    fills: dict[fx.Node, Set] = field(default_factory=dict)
    copies: dict[fx.Node, Set] = field(default_factory=dict)
    forwards: dict[fx.Node, Runs] = field(default_factory=dict)
    constants: dict[fx.Node, Set] = field(default_factory=dict)


def read_demand(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node],
                exposed: Mapping[fx.Node, Extent] | None = None, origins: Origins | None = None,
                entangled: AbstractSet[fx.Node] | None = None) -> Demand:
    """The read demand of the slice ``nodes`` (program order) whose values ``keep`` are
    kept; ``exposed``: kept nodes of which only this storage extent is read; ``origins``
    (``passes.origins``): where copies may draw what they write instead of reading it;
    ``entangled``: ``roots.shared_roots(nodes)``, if known."""
    exposed = exposed or {}
    need: dict[fx.Node, Set] = defaultdict(lambda: intervals.EMPTY)
    for k in keep:
        # a kept value needs all of its storage, as eager's does (``torch.save`` writes it,
        # storage views see it); an exposed one only the extent the caller reads
        root = storage_root(k)
        read = intervals.of([exposed[k]]) if k in exposed else intervals.elements_of(root)[0]
        need[root] = intervals.union(need[root], read)
    found = Demand()
    for n in reversed(nodes):
        _step(n, need, found, origins)
    entangled = shared_roots(nodes) if entangled is None else entangled
    found.fills = {n: s for n, s in found.fills.items() if storage_root(filled(n)) not in entangled}
    found.copies = {n: s for n, s in found.copies.items() if storage_root(n) not in entangled}
    found.forwards = {n: r for n, r in found.forwards.items() if n in found.copies}
    found.constants = {n: s for n, s in found.constants.items() if n not in entangled}
    return found


def only_whole(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node],
               exposed: Mapping[fx.Node, Extent] | None = None) -> bool:
    """Whether the walk can find nothing to leave out, so that its answer (``Demand()``: every
    fill, copy and constant whole) is known without it: nothing is exposed, every random fill
    writes a storage a kept value needs whole, and so does every copy and one-value factory
    large enough to be split (``PARTIAL_COPY_MIN``, ``PARTIAL_CONSTANT_MIN``). The walk could
    then leave out only what later writes overwrite (a row copied over a filled weight, a
    fill overwritten whole), which is written anyway, as eager writes it: the answer is the
    same values, at most slower. A whole unsharded model is asked this first (the 32-layer
    Llama of hidden size 64: its plan 16 -> 9 ms with the lazy groups, ``Plan.groups``)."""
    if exposed:
        return False
    kept = {storage_root(k) for k in keep}
    for n in nodes:
        if n.op != "call_function":
            continue
        if n.meta.get("generators"):
            written = filled(n)
            if written is not None and storage_root(written) not in kept:
                return False
            continue
        copy = copied_views(n)
        if copy is not None:
            if storage_root(copy.root) not in kept and copy.dst.numel >= PARTIAL_COPY_MIN:
                return False
            continue
        spec = n.meta.get("spec")
        if constant_value(n) is not None and n not in kept and (spec is None or spec.numel >= PARTIAL_CONSTANT_MIN):
            return False
    return True


def _step(n: fx.Node, need: dict[fx.Node, Set], found: Demand, origins: Origins | None) -> None:
    """Move ``need`` from after ``n`` to before it (see the module doc)."""
    random = n.meta.get("generators")
    if not n._input_nodes and not random:  # a factory or a constant: reads nothing
        if constant_value(n) is not None:
            found.constants[n] = need.get(n, intervals.EMPTY)
        need.pop(n, None)
        return
    if random and n.op == "call_function" and not reads_no_data(n):  # (a random op is no view, no constant)
        written = filled(n)
        if n.meta.get("overwrites") and written is not None and not reinterprets(written):
            root = storage_root(written)
            covered, exact = intervals.elements_of(written)
            found.fills[n] = intervals.intersect(need[root], covered)
            if exact:
                need[root] = intervals.subtract(need[root], covered)
            _read_all(n, need, skip=written)
        else:
            _read_all(n, need)
            need.pop(n, None)
        return
    if n.op == "call_function" and is_view(n):
        return  # reads nothing
    if constant_value(n) is not None:
        found.constants[n] = need.get(n, intervals.EMPTY)
    if n.op != "call_function" or reads_no_data(n):
        need.pop(n, None)  # a constant or an allocation: its storage did not exist before
        return
    copy = copied_views(n)
    if copy is not None and copy.reinterpreted:  # positions unknown: it reads all of its source
        _read(copy.src, None, need)
        if n.target is not aten.copy_.default:
            need.pop(n, None)
        return
    if copy is not None and n.target is aten.copy_.default:
        covered, exact = intervals.elements(copy.dst)
        demanded = intervals.intersect(need[copy.root], covered)
        if exact:
            need[copy.root] = intervals.subtract(need[copy.root], covered)
        _copy(n, copy, demanded, need, found, origins)
        return
    if copy is not None:  # a new storage: what is demanded of it before it existed ends here
        demanded = intervals.intersect(need.pop(n, intervals.EMPTY), intervals.elements(copy.dst)[0])
        _copy(n, copy, demanded, need, found, origins)
        return
    target = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if _pointwise(n) and not any(reinterprets(x) or not _floating(x) for x in (n, *n._input_nodes)):
        written = target if writes_first_argument(n) else n
        out = written.meta.get("spec")
        demanded = intervals.intersect(need[storage_root(written)], intervals.elements(out)[0])
        if written is n:
            need.pop(n, None)
        for x in n._input_nodes:
            if x is written:
                continue  # in place: the positions it writes are the positions it reads
            _read(x, intervals.carry(demanded, out, x.meta.get("spec")), need)
        return
    _read_all(n, need)
    if not writes_first_argument(n):
        need.pop(n, None)


def _copy(n: fx.Node, copy: Copied, demanded: Set, need: dict[fx.Node, Set], found: Demand,
          origins: Origins | None) -> None:
    """Copy ``n`` must write ``demanded``: it draws the part whose origin is a fill (in long
    enough runs), and reads the rest from its source."""
    runs = origins.at.get(n) if origins is not None else None
    if runs is not None and len(demanded):
        mine = restrict(runs, demanded)
        if len(mine) and intervals.size(mine[:, :2]) >= FORWARD_RUN_MIN * len(mine):
            found.forwards[n] = mine
            demanded = intervals.subtract(demanded, mine[:, :2])
    found.copies[n] = demanded
    _read(copy.src, intervals.carry(demanded, copy.dst, copy.src_view), need)


def _floating(x: fx.Node) -> bool:
    """``x`` holds floating or complex values: values nobody reads, whatever their bits, make
    an element-wise op raise nothing (an integer division by a zero there would)."""
    spec = x.meta.get("spec")
    return spec is None or spec.dtype.is_floating_point or spec.dtype.is_complex


def _pointwise(n: fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return torch.Tag.pointwise in tags and n.meta.get("spec") is not None


def _read(x: fx.Node, elements: Set | None, need: dict[fx.Node, Set]) -> None:
    """``x``'s storage is read at ``elements`` (None: all of ``x``)."""
    if reinterprets(x):
        elements = intervals.EVERYTHING
    if elements is None:
        elements = intervals.elements_of(x)[0] if x.meta.get("spec") is not None else intervals.EVERYTHING
    root = storage_root(x)
    need[root] = intervals.union(need[root], elements)


def _read_all(n: fx.Node, need: dict[fx.Node, Set], skip: fx.Node | None = None) -> None:
    for x in n._input_nodes:
        if x is not skip:
            _read(x, None, need)


def partial_fills(demand: Demand) -> dict[fx.Node, Ranges]:
    """``{random node: ranges}`` for whole-storage random fills of which only part is read
    later (the ranges of its target's storage that are; none at all for a fill nothing reads)."""
    out: dict[fx.Node, Ranges] = {}
    for n, demanded in demand.fills.items():
        spec = filled(n).meta.get("spec")
        if not len(demanded) or (spec is not None and spec.storage_offset == 0 and _strict_part(demanded, spec)):
            out[n] = intervals.as_list(demanded)
    return out


#: Copies of fewer elements than this run whole: piecewise copying would not pay.
PARTIAL_COPY_MIN = 1 << 16


def partial_copies(demand: Demand) -> dict[fx.Node, Ranges]:
    """``{copy: ranges}`` for copies (``copy_``, ``clone``, ``_to_copy``) of which only part
    is read later, or that draw part of it (``Demand.forwards``): the ranges of their
    output's storage they copy (none at all for a copy nothing reads)."""
    out: dict[fx.Node, Ranges] = {}
    for n, demanded in demand.copies.items():
        spec = (n.args[0] if n.target is aten.copy_.default else n).meta.get("spec")
        if spec is None or not spec.numel:  # (an empty one runs as torch runs it: eager's strides)
            continue
        if n in demand.forwards or not len(demanded) or (
                spec.numel >= PARTIAL_COPY_MIN and _strict_part(demanded, spec)):
            out[n] = intervals.as_list(demanded)
    return out


#: Factories of one value smaller than this write all of it.
PARTIAL_CONSTANT_MIN = 1 << 16


def partial_constants(demand: Demand) -> dict[fx.Node, Ranges]:
    """``{factory: ranges}`` for factories of a tensor of one value (``zeros``, ``new_full``)
    of which only part is read before it is overwritten (FSDP's padded buffer, into which
    the shard is then copied): the ranges of its storage worth writing."""
    out: dict[fx.Node, Ranges] = {}
    for n, demanded in demand.constants.items():
        spec = n.meta.get("spec")
        if spec is not None and spec.numel and spec.numel >= PARTIAL_CONSTANT_MIN and (
                not len(demanded) or _strict_part(demanded, spec)):
            out[n] = intervals.as_list(demanded)
    return out


def _strict_part(demanded: Set, spec) -> bool:  # noqa: ANN001
    """``demanded`` is some, but not all, of the elements ``spec`` covers, and those are known."""
    if len(demanded) == 1 and spec.is_contiguous():  # the common case, a whole tensor, without sets
        lo, hi = demanded[0].tolist()
        if lo <= spec.storage_offset and spec.storage_offset + spec.numel <= hi:
            return False
    covered, exact = intervals.elements(spec)
    return exact and intervals.size(demanded) > 0 and intervals.size(intervals.subtract(covered, demanded)) > 0
