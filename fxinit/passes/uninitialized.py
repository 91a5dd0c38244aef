"""Reads of memory that no recorded op wrote, where eager construction would have written it.

A model's own ``torch.empty`` holds garbage in eager construction too, and so may its
materialized value. Buffers that library code allocates to receive data (a scatter's
output, a gather's) are different: eager fills them by communicating, and if capture
missed that write, the value read from them is memory nobody wrote. The recorder marks
such allocations (``meta["fill_expected"]``: made by torch.distributed code after the
trace); a slice that reads one before any op writes it must not run.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import ALLOCATIONS, is_view, reads_no_data, view_base

_COPIES = frozenset({torch.ops.aten.clone, torch.ops.aten._to_copy})  # a value as it is (cast or not)


def never_written(nodes: Sequence[fx.Node], outputs: Mapping[str, fx.Node], output_storage: Mapping[str, int]
                  ) -> list[str]:
    """Names of the outputs whose values no op writes: an allocation left as it is
    (``torch.empty`` & co.), or a copy of one, at any depth (``copy.deepcopy``'s clones of a
    layer, ``_get_clones``; a ``.to(dtype)``). Their values are whatever memory held, in eager
    construction and in materialization alike (``InitGraph.uninitialized``)."""
    written = {sid for n in nodes for sid in n.meta.get("mutates", ())}

    def unwritten(node: fx.Node, sid: int) -> bool:
        if sid in written:
            return False
        base = view_base(node)
        if base.target in ALLOCATIONS:
            return True
        reads = base.meta.get("reads", ())
        return getattr(base.target, "overloadpacket", None) in _COPIES and len(reads) == 1 and \
            isinstance(base.args[0], fx.Node) and unwritten(base.args[0], reads[0])

    return [name for name, node in outputs.items() if unwritten(node, output_storage[name])]


def unwritten_reads(nodes: Sequence[fx.Node], targets: Iterable[tuple[fx.Node, int]] = ()
                    ) -> list[tuple[fx.Node, fx.Node]]:
    """``[(reader, allocation)]``: nodes of the slice ``nodes`` (program order) that read the
    storage of an allocation marked ``fill_expected`` before any node wrote it, and the
    ``targets`` (``(value node, storage id)``, as for slicing) whose storage is still unwritten."""
    pending: dict[int, fx.Node] = {}  # storage id -> its allocation, until something writes it
    found: list[tuple[fx.Node, fx.Node]] = []
    for n in nodes:
        if n.meta.get("fill_expected"):
            pending.update((sid, n) for sid in n.meta.get("allocates", ()))
            continue
        if not pending:
            continue
        if not is_view(n) and not reads_no_data(n):
            written = set(n.meta.get("mutates", ()))
            found.extend((n, pending[sid]) for sid in n.meta.get("reads", ()) if sid in pending and sid not in written)
        for sid in n.meta.get("mutates", ()):
            pending.pop(sid, None)
    found.extend((node, pending[sid]) for node, sid in targets if sid in pending)
    return found
