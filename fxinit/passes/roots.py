"""Storage roots: which node created the storage a value lives in, and which roots may share one.

The element analyses (``passes.demand``, ``passes.origins``) follow storages, not values:
a view, a ``copy_`` into a view and an in-place op all act on the storage their first
argument lives in. They name a storage by the node that created it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.fx as fx

from fxinit.ops import filled_argument, is_view, per_node, per_target


@per_node
def storage_root(node: fx.Node) -> fx.Node:
    """The node that created ``node``'s storage: up through views and through in-place ops
    (their result is their first argument, ``t_`` and ``copy_`` alike)."""
    root = node
    while is_view(root) or writes_first_argument(root):
        parent = root.args[0] if root.args else None
        if not isinstance(parent, fx.Node):
            break
        root = parent
    return root


def writes_first_argument(node: fx.Node) -> bool:
    """``node`` writes its first argument and returns it (``add_``, ``copy_``, ``t_``)."""
    return _writes_first(node.target)


@per_target
def _writes_first(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    ret, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return ret is not None and ret.is_write and first is not None and first.is_write


def reinterprets(node: fx.Node) -> bool:
    """``node`` views its storage as another dtype than the one that made it (``view(dtype)``,
    complex views): its offset and strides count in other units, its elements are other
    bits, so the element analyses take it as an unknown layout."""
    spec, root = node.meta.get("spec"), storage_root(node).meta.get("spec")
    return spec is not None and root is not None and spec.dtype != root.dtype


def filled(n: fx.Node) -> fx.Node | None:
    """The tensor argument ``n`` writes in place (``ops.filled_argument``), or None."""
    index = filled_argument(n)
    arg = n.args[index] if index is not None and len(n.args) > index else None
    return arg if isinstance(arg, fx.Node) else None


def shared_roots(nodes: Sequence[fx.Node]) -> set[fx.Node]:
    """Storage roots that may share their storage with another root (an op such as ``set_``):
    the capture's storage ids (``meta["reads"]``, ``meta["mutates"]``) of nodes reading one
    root disagree; and roots whose storage ``resize_`` changed (the elements it holds are not
    its spec's any more). The element analyses keep every fill and copy of these whole."""
    ids: dict[fx.Node, set[Any]] = defaultdict(set)
    resized: set[fx.Node] = set()  # (their root's spec no longer says which elements the storage has)
    for n in nodes:
        if id(n.target) in _RESIZES and n.args and isinstance(n.args[0], fx.Node):
            resized.add(storage_root(n.args[0]))
        roots = {storage_root(x) for x in n._input_nodes}
        sids = set(n.meta.get("reads", ())) | set(n.meta.get("mutates", ()))
        if len(roots) == 1 and len(sids) == 1:
            ids[next(iter(roots))] |= sids
    by_id: dict[Any, set[fx.Node]] = defaultdict(set)
    for root, sids in ids.items():
        for sid in sids:
            by_id[sid].add(root)
    shared = {root for roots in by_id.values() if len(roots) > 1 for root in roots}
    return shared | resized | {root for root, sids in ids.items() if len(sids) > 1}


_RESIZES = frozenset({id(torch.ops.aten.resize_.default), id(torch.ops.aten.resize_as_.default)})  # by id: ops live on
