"""The autograd links of tensors that eager computes from parameters and keeps on the module.

``self.t = self.w[0]``, ``register_buffer("b", self.w.clone())``, the old
``nn.utils.weight_norm``'s ``weight``: in eager construction such a tensor has a ``grad_fn``
that leads to the parameters, so a backward through it reaches them. Materialize computes its
value like any other, as a leaf. Here, before the swap, each such tensor is matched with the
recorded ops that made it from parameters (``plan_links``); after the swap those ops run
again on the real parameters with autograd on (``relink``): the same aten ops on the same
values, so the same bits (checked against the value materialize computed), and eager's
``grad_fn``. The other inputs of those ops are taken as eager's ops took them: constants the
capture holds (an index ``torch.tensor([1, 5])``), value factories (``torch.full``) run again,
and tensors materialized in the same call (prune's ``weight_mask``), each only where no op
writes it after the tensor was computed (constants and factories: nowhere), so that the
value taken is the value eager's op read. A view of a parameter is rebuilt as a view of the
real parameter, whatever was written into it since (a view sees those writes in eager too).
A tensor whose ops cannot be replayed so (its parameters written since it was computed, a
random or in-place op on the way) keeps its value, as a leaf: docs/failure-modes.md says so.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxinit.capture.deferred import dressed_as, is_deferred_tensor, plain_attributes, state_of
from fxinit.passes.roots import storage_root

_MAX_OPS = 64  # a longer recipe is not the kind of tensor this is for


@dataclass
class Link:
    """How to rebuild ``tensor`` from ``leaves`` (node -> parameter object): run ``nodes``."""

    tensor: torch.Tensor
    nodes: list[fx.Node]
    leaves: dict[fx.Node, torch.Tensor]


@dataclass
class _Inputs:
    """What the replayed ops of one trace may start from (``_replay_link``)."""

    parameters: dict[fx.Node, torch.Tensor]  # by their current node
    held: dict[fx.Node, torch.Tensor]  # other tensors materialized in this call, by their current node
    constants: dict[str, torch.Tensor]  # the capture's constants, by get_attr target
    written: dict[fx.Node, int]  # storage roots written in place: the position of their last write


def plan_links(tensors: list[torch.Tensor]) -> list[Link]:
    """The links of the derived tensors among ``tensors`` that can be rebuilt (before the swap)."""
    with plain_attributes():
        derived = [t for t in tensors if t.grad_fn is not None]
    if not derived:
        return []
    links = []
    by_recorder: dict[int, _Inputs] = {}
    for t in derived:
        rec = state_of(t).recorder
        if id(rec) not in by_recorder:
            by_recorder[id(rec)] = _inputs(rec, tensors)
        inputs = by_recorder[id(rec)]
        link = _view_link(t, inputs.parameters) or _replay_link(t, inputs)
        if link is not None:
            links.append(link)
    return links


def relink(links: list[Link]) -> None:
    """Rebuild each planned tensor from the now real parameters (after the swap), the ones
    computed last first: an older ``grad_fn`` of a later tensor holds the earlier tensors it
    read, and swapping those waits until it is gone."""
    for link in sorted(links, key=lambda link: -link.nodes[-1].meta["pos"] if link.nodes else 0):
        if any(is_deferred_tensor(p) or p.grad_fn is not None for p in link.leaves.values()):
            continue  # its parameters were not materialized by this call
        t = link.tensor
        if t.is_meta:
            continue  # no values to check the replay against
        try:
            with torch.enable_grad():
                value = _run(link)
            same = _same(value, t)
        except Exception:  # noqa: BLE001 - the tensor keeps its (right) value as a leaf
            continue
        if not same:
            continue
        new = dressed_as(t, value, keep_autograd=True)
        try:
            torch.utils.swap_tensors(t, new)
        except RuntimeError as exc:
            warnings.warn(f"fxinit: a tensor computed with autograd from parameters keeps its value but not its "
                          f"grad_fn ({exc}): compute it after materialize to have eager's", stacklevel=4)
        del new


def autograd_leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors ``t``'s ``grad_fn`` leads to (the parameters it was computed from)."""
    out: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)  # AccumulateGrad
        if isinstance(variable, torch.Tensor):
            out.setdefault(id(variable), variable)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return list(out.values())


def _inputs(rec: Any, tensors: list[torch.Tensor]) -> _Inputs:
    """Leaf tensors that require grad (the parameters of the traced model, and any other such
    tensor being materialized), the other tensors being materialized, and where the trace
    writes in place."""
    parameters: dict[fx.Node, torch.Tensor] = {}
    held: dict[fx.Node, torch.Tensor] = {}
    candidates = list(tensors)
    if rec.root is not None:
        candidates += list(rec.root.parameters())
    with plain_attributes():
        for p in candidates:
            if is_deferred_tensor(p) and p.grad_fn is None:
                (parameters if p.requires_grad else held).setdefault(state_of(p).node, p)
    written: dict[fx.Node, int] = {}
    for n in rec.graph.nodes:
        if n.meta.get("mutates"):
            for x in n.all_input_nodes:
                root = storage_root(x)
                written[root] = max(written.get(root, -1), n.meta["pos"])
    return _Inputs(parameters, held, rec.constants, written)


def _view_link(t: torch.Tensor, parameters: dict[fx.Node, torch.Tensor]) -> Link | None:
    """A view of a parameter: its chain of view ops, replayed on the parameter as it is now."""
    if not t._is_view() or not any(t._base is p for p in parameters.values()):
        return None
    chain: list[fx.Node] = []
    node = state_of(t).node
    while isinstance(node, fx.Node) and getattr(node.target, "is_view", False) and len(chain) < _MAX_OPS:
        chain.append(node)
        node = node.args[0] if node.args else None
    if not chain or not isinstance(node, fx.Node):
        return None
    return Link(t, chain[::-1], {node: t._base})


def _replay_link(t: torch.Tensor, inputs: _Inputs) -> Link | None:
    """Pure, not random ops from parameters (at their current values) to ``t``, and the other
    inputs they took as eager's ops took them (see the module doc)."""
    needed: dict[fx.Node, None] = {}
    leaves: dict[fx.Node, torch.Tensor] = {}
    made = state_of(t).node.meta["pos"]
    todo = [state_of(t).node]
    while todo:
        node = todo.pop()
        if node in needed or node in leaves:
            continue
        if node in inputs.parameters:
            leaves[node] = inputs.parameters[node]
            continue
        if node in inputs.held and inputs.written.get(storage_root(node), -1) < made:
            leaves[node] = inputs.held[node]
            continue
        if node.op == "get_attr" and node.target in inputs.constants and storage_root(node) not in inputs.written \
                and not inputs.constants[node.target].requires_grad:  # a copy of the caller's tensor: no path to it
            leaves[node] = inputs.constants[node.target]
            continue
        if node.op != "call_function" or node.meta.get("generators") or node.meta.get("mutates") \
                or len(needed) >= _MAX_OPS:
            return None
        if not node.all_input_nodes and (getattr(node.target, "overloadpacket", None) not in _VALUE_FACTORIES
                                         or node in inputs.written):
            return None
        needed[node] = None
        todo.extend(node.all_input_nodes)
    if not any(p in inputs.parameters for p in leaves):
        return None
    return Link(t, sorted(needed, key=lambda n: n.meta["pos"]), leaves)


#: Ops without tensor inputs that run again to the same values (``empty`` does not).
_VALUE_FACTORIES = frozenset(getattr(torch.ops.aten, name) for name in (
    "full", "zeros", "ones", "arange", "linspace", "logspace", "eye", "scalar_tensor"))


def _run(link: Link) -> torch.Tensor:
    env: dict[fx.Node, Any] = dict(link.leaves)

    def value(x: Any) -> Any:
        return env[x] if isinstance(x, fx.Node) else x

    for node in link.nodes:
        args = fx.node.map_aggregate(node.args, value)
        kwargs = fx.node.map_aggregate(node.kwargs, value)
        env[node] = node.target(*args, **kwargs)
    return env[link.nodes[-1]]


def _same(value: torch.Tensor, t: torch.Tensor) -> bool:
    """``value`` is what materialize put into ``t`` (bits, shape, strides)."""
    if not isinstance(value, torch.Tensor) or value.shape != t.shape or value.dtype != t.dtype \
            or value.stride() != t.stride() or value.device != t.device:
        return False
    a, b = value.detach(), t.detach()
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
