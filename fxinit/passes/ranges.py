"""Storage extents of rows, and how much of a storage a run writes.

A caller that reads only part of a kept value (rows ``start .. stop`` of a tensor too
large to hold whole, see ``InitGraph.materialize(rows=...)``) says so with an extent
(``rows_extent``); the read demand (``passes.demand``) then counts the kept value as a
reader of that extent only, and ``written_elements`` tells how much of a storage such a
run still writes (to decide whether computing a tensor in pieces costs in proportion to
the pieces).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch.fx as fx

from fxinit.ops import ALLOCATIONS, view_base


Extent = tuple[int, int]  # half-open range of storage elements
Ranges = list[Extent]  # sorted, disjoint


def storage_extent(spec) -> Extent | None:  # noqa: ANN001
    """The storage elements a view of ``spec`` spans (None: unknown, a negative stride)."""
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
    return storage_extent(rows)


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
