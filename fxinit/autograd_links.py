"""The autograd links of tensors that eager computes from parameters and keeps on the module:
which recorded ops rebuild each (``plan_links``, before the swap); ``fxinit.autograd_replay``
runs them again after it.

``self.t = self.w[0]``, ``register_buffer("b", self.w.clone())``, the old
``nn.utils.weight_norm``'s ``weight``: in eager construction such a tensor has a ``grad_fn``
that leads to the parameters, so a backward through it reaches them. Materialize computes its
value like any other, as a leaf. Here, before the swap, each such tensor is matched with the
recorded ops that made it from parameters; after the swap those ops run
again on the real parameters with autograd on: the same aten ops on the same
values, so the same bits (checked against the value materialize computed), and eager's
``grad_fn``. The other inputs of those ops are taken as eager's ops took them: constants the
capture holds (an index ``torch.tensor([1, 5])``), value factories (``torch.full``) run again,
and tensors materialized in the same call (prune's ``weight_mask``), each only where no op
writes it after eager's op read it (constants and factories: nowhere), so that the value
taken is the value eager's op read. A view of a parameter is rebuilt as a view of the
real parameter, whatever was written into it since (a view sees those writes in eager too).
In-place writes to the kept tensor and to the temporaries it was computed from run again
too, in their order and each in the grad mode eager ran it in (``self.b.add_(self.w1)`` with
autograd on is part of eager's ``grad_fn``).

Where eager's ops read what cannot be replayed so (``_link``, given ``value_of``), the values
they read are computed (``ValueOf``: the slice up to the reading op): a parameter written or
rebound since (``weight_norm``, then ``weight_g`` filled; frozen or ``.double()`` since) holds
its value then while the ops run again, and a random or written temporary no gradient passes is
taken as its value. Such a rebuilt tensor must have eager's ``grad_fn`` graph
(``graph_signature``, recorded by the capture's own autograd), besides eager's bits. A tensor
that cannot be rebuilt keeps its value, as a leaf: docs/failure-modes.md says when.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Sequence

import torch
import torch.fx as fx

from fxinit.capture.deferred import is_deferred_tensor, plain_attributes, state_of
from fxinit.capture.grad_hooks import UNTRACKED
from fxinit.capture.schema import mutated_arg_indices, schema_value
from fxinit.grad_graphs import autograd_leaves, graph_signature
from fxinit.numerics import Settings
from fxinit.ops import is_view, reads_no_data
from fxinit.passes.roots import storage_root, writes_first_argument

_MAX_OPS = 64  # a longer recipe is not the kind of tensor this is for


@dataclass
class Link:
    """How to rebuild ``tensor`` from ``leaves`` (node -> parameter object): run ``nodes``.
    ``earlier``: leaves that are a parameter as it was before later writes (node -> the node
    that read it then): the parameter holds that value again while ``nodes`` run;
    ``values``: inputs taken as the values they had (node -> the node that read them), not
    replayed; ``value_of`` computes both. ``signature``: the ``grad_fn`` graph the rebuilt
    tensor must have (``graph_signature`` of eager's, recorded by the capture), checked for
    every replay (not for a view of a parameter, whose ``grad_fn`` torch regenerates)."""

    tensor: torch.Tensor
    nodes: list[fx.Node]
    leaves: dict[fx.Node, torch.Tensor]
    earlier: dict[fx.Node, fx.Node] = field(default_factory=dict)
    values: dict[fx.Node, fx.Node] = field(default_factory=dict)
    signature: list | None = None
    value_of: Callable[[fx.Node, fx.Node], torch.Tensor] | None = None
    reached: tuple[torch.Tensor, ...] = ()  # the leaves eager's grad_fn reaches (they required grad then)
    overwritten: bool = False  # ``tensor`` itself written after (under no_grad): its values copied in after
    result: fx.Node | None = None  # the node whose value is ``tensor`` (default: the last of ``nodes``)
    fallback: Link | None = None  # tried where this one's replay is not eager's (``_link``)
    written: frozenset[fx.Node] = frozenset()  # leaves the ops write in place (constants: copied first)
    eager: str = ""  # eager's grad_fn and where the tensor was computed (a warning's words where it is lost)
    settings: Settings | None = None  # torch's settings the trace recorded ``nodes`` under (``fxinit.numerics``)
    cast_to: torch.dtype | None = None  # ``materialize(dtype=)`` casts ``tensor``: eager's ``Module.to`` did, with autograd


@dataclass
class _Inputs:
    """What the replayed ops of one trace may start from (``_link``)."""

    parameters: dict[fx.Node, torch.Tensor]  # by their current node
    held: dict[fx.Node, torch.Tensor]  # other tensors materialized in this call, by their current node
    constants: dict[str, torch.Tensor]  # the capture's constants, by get_attr target
    written: dict[fx.Node, int]  # storage roots written in place: the position of their last write
    lifted: dict[str, torch.Tensor]  # constants' real tensors that require grad (``Recorder.lifted_with_grad``)
    # nodes that several parameters stand for (``Parameter(torch.from_numpy(p.detach().numpy()))``:
    # another object on the same storage), each with all of them
    aliased: dict[fx.Node, list[torch.Tensor]] = field(default_factory=dict)
    writes: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # storage root -> the ops writing it, in order
    # leaves eager's ``grad_fn`` reaches that ``.data = real`` made real since (by ``id`` of what the
    # capture's autograd holds: the deferred tensor each was) -> the object each is now (``now_real``)
    successors: dict[int, torch.Tensor] = field(default_factory=dict)
    cast: AbstractSet[int] = frozenset()  # tensors (by ``id``) ``materialize(dtype=)`` casts, as ``Module.to`` would

    def preferring(self, leaves: AbstractSet[int]) -> _Inputs:
        """These inputs, a node that several parameters stand for standing for the one among
        ``leaves`` (by ``id``: the leaves eager's ``grad_fn`` reaches) where there is one."""
        if not self.aliased:
            return self
        parameters = dict(self.parameters)
        for node, params in self.aliased.items():
            parameters[node] = next((p for p in params if id(p) in leaves), params[0])
        return dataclasses.replace(self, parameters=parameters)


#: ``value_of(recorder, node, reader)``: the value ``node`` had when ``reader`` read it (writes
#: to its storage after that left out), computed as materialize computes values (exact or
#: portable, on the target device).
ValueOf = Callable[[Any, fx.Node, fx.Node], torch.Tensor]


def plan_links(tensors: list[torch.Tensor], value_of: ValueOf | None = None,
               cast: AbstractSet[int] = frozenset(), dtype: torch.dtype | None = None) -> list[Link]:
    """The links of the derived tensors among ``tensors`` that can be rebuilt (before the
    swap); ``value_of`` gives the inputs eager's ops read that nothing can replay (a
    parameter as it was before a later write, a random or written temporary). ``cast``: the
    tensors (by ``id``) ``materialize(dtype=dtype)`` casts, as eager's ``Module.to(dtype)``
    after construction: its parameters are rebound since the ops ran (``.data =``), and a kept
    buffer is ``.to(dtype)`` of its value then, with autograd (``ToCopyBackward0``)."""
    with plain_attributes():
        derived = [t for t in tensors if t.grad_fn is not None]
    if not derived:
        return []
    links = []
    by_recorder: dict[int, _Inputs] = {}
    with plain_attributes():
        leaves_of = [autograd_leaves(t) for t in derived]
    swapped = {id(p): (p, now) for leaves in leaves_of for p in leaves if (now := now_real(p)) is not None}
    # they required grad there, whatever they do now
    reached = {id(swapped[id(p)][1] if id(p) in swapped else p) for leaves in leaves_of for p in leaves}
    for t, reaches in zip(derived, leaves_of):
        rec = state_of(t).recorder
        if id(rec) not in by_recorder:
            by_recorder[id(rec)] = dataclasses.replace(_inputs(rec, tensors, reached, list(swapped.values())),
                                                       cast=cast)
        mine = {id(swapped[id(p)][1] if id(p) in swapped else p) for p in reaches}
        inputs = by_recorder[id(rec)].preferring(mine)
        link = (None if id(t) in cast else _view_link(t, inputs.parameters)) or _link(
            t, reaches, inputs, None if value_of is None else functools.partial(value_of, rec))
        if link is None or (id(t) in cast and _regenerated_by_its_cast(t, inputs)):
            link = Link(t, [], {})  # none: it keeps its value, as a leaf (``relink`` says so)
        if id(t) in cast:
            each: Link | None = link
            while each is not None:
                each.cast_to, each = dtype, each.fallback
        link.reached = tuple({id(p): p for p in link.leaves.values() if id(p) in mine}.values())
        link.eager = _eager_words(t)
        link.settings = Settings(rec.default_dtype, rec.numerics)
        links.append(link)
    return links


def now_real(p: torch.Tensor) -> torch.Tensor | None:
    """The object the leaf ``p`` is now, where ``.data = real`` made it real since eager's ops
    read it (``vector_to_parameters`` after the trace): eager's ``grad_fn`` holds the object
    the model holds, the capture's the deferred tensor it was, swapped out of that object
    (``capture.real.adopt_real``). None for any other leaf."""
    now = state_of(p).now if is_deferred_tensor(p) else None
    while now is not None and is_deferred_tensor(now) and state_of(now).now is not None:
        now = state_of(now).now
    return now


def _eager_words(t: torch.Tensor) -> str:
    """``t``'s ``grad_fn`` (recorded by the capture) and the source line that computed it."""
    with plain_attributes():
        fn = type(t.grad_fn).__name__
    prov = state_of(t).node.meta.get("prov")
    source = getattr(prov, "source", None)
    return f"{fn}, {source}" if source else fn


def _inputs(rec: Any, tensors: list[torch.Tensor], reached: AbstractSet[int] = frozenset(),
            swapped: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> _Inputs:
    """Leaf tensors that require grad (the parameters of the traced model, and any other such
    tensor being materialized) or that a kept tensor's ``grad_fn`` reaches (``reached``, by
    ``id``: a parameter frozen since; ``swapped``: made real since, as each was and is, see
    ``now_real``), the other tensors being materialized, and where the trace writes in place."""
    parameters: dict[fx.Node, torch.Tensor] = {}
    held: dict[fx.Node, torch.Tensor] = {}
    aliased: dict[fx.Node, list[torch.Tensor]] = {}
    candidates = list(tensors)
    if rec.root is not None:
        candidates += list(rec.root.parameters())
    with plain_attributes():
        for p in candidates:
            if is_deferred_tensor(p) and p.grad_fn is None:
                node = state_of(p).node
                if p.requires_grad or id(p) in reached:
                    first = parameters.setdefault(node, p)
                    if first is not p and all(q is not p for q in aliased.setdefault(node, [first])):
                        aliased[node].append(p)
                else:
                    held.setdefault(node, p)
    successors = {}
    for was, now in swapped:
        if state_of(was).recorder is rec:
            parameters.setdefault(state_of(was).node, now)
            successors[id(was)] = now
    written: dict[fx.Node, int] = {}
    writes: dict[fx.Node, list[fx.Node]] = {}
    for n in rec.graph.nodes:
        if n.meta.get("mutates"):
            for root in written_roots(n):
                written[root] = max(written.get(root, -1), n.meta["pos"])
                writes.setdefault(root, []).append(n)
    return _Inputs(parameters, held, rec.constants, written, rec.lifted_with_grad, aliased, writes, successors)


def roots_written_by(nodes: list[fx.Node]) -> set[fx.Node]:
    """The storage roots the in-place ops among ``nodes`` write."""
    return {root for n in nodes if writes_first_argument(n) for root in written_roots(n)}


def written_roots(n: fx.Node) -> set[fx.Node]:
    """The storage roots the recorded op ``n`` writes: the arguments its schema marks written
    (``y.add_(x)`` writes ``y``, reads ``x``), or, where that cannot be told, all it reads."""
    if getattr(n.target, "_schema", None) is not None:
        written = [schema_value(n.target, n.args, n.kwargs, i) for i in mutated_arg_indices(n.target)]
        if written and all(isinstance(x, fx.Node) for x in written):
            return {storage_root(x) for x in written}
    return {storage_root(x) for x in n.all_input_nodes}


def _view_link(t: torch.Tensor, parameters: dict[fx.Node, torch.Tensor]) -> Link | None:
    """A view of a parameter: its chain of view ops, replayed on the parameter as it is now."""
    if not t._is_view() or not any(t._base is p for p in parameters.values()):
        return None
    chain: list[fx.Node] = []
    node = state_of(t).node
    base = state_of(t._base).node  # itself a view op's where the parameter was made as a view (weight_norm's g)
    while isinstance(node, fx.Node) and node is not base and getattr(node.target, "is_view", False) \
            and len(chain) < _MAX_OPS:
        chain.append(node)
        node = node.args[0] if node.args else None
    if not chain or node is not base:
        return None  # (a view of what the parameter held before ``.data =``: _link)
    return Link(t, chain[::-1], {node: t._base})


def _link(t: torch.Tensor, reaches: list[torch.Tensor], inputs: _Inputs,
          value_of: Callable[[fx.Node, fx.Node], torch.Tensor] | None = None) -> Link | None:
    """The recorded ops from the parameters ``t``'s ``grad_fn`` reaches (``reaches``) to ``t``, and the other
    inputs they took as eager's ops took them (see the module doc). A parameter written after
    eager's op read it (``weight_norm``'s ``weight``, then ``weight_g`` filled), or rebound since,
    holds its value then while the ops run again; anything else that cannot be replayed (a random
    or written temporary, a parameter eager's op read with no gradient) is taken as the value it
    had, where no gradient passes it. Both need ``value_of``; without it such a tensor has no link.
    The rebuilt tensor must have eager's ``grad_fn`` graph (``signature``).

    First choice: the in-place writes to ``t`` and to the temporaries it was computed from run
    again too, each in the grad mode eager ran it in (``self.b = self.w.clone()``, then
    ``self.b.add_(self.w1)``: eager's ``grad_fn`` is ``AddBackward0``), and what a view reads
    is read where the view's reader reads it (``self.b = self.w.expand(2)``, ``self.w`` written
    under no_grad, then ``.double()``: eager's ``b`` saw the write). Where that replay is not
    eager's, or a write cannot run again (a random fill), the ``fallback`` takes written
    temporaries as their values and copies ``t``'s later values in."""
    with plain_attributes():
        signature = graph_signature(t)
    if inputs.successors:  # the replay's leaf is the object the parameter is now
        signature = [("AccumulateGrad", id(inputs.successors[entry[1]]), *entry[2:])
                     if entry and entry[0] == "AccumulateGrad" and entry[1] in inputs.successors else entry
                     for entry in signature]
    if inputs.cast:
        signature = _cast_since(signature, inputs.cast, id(t) in inputs.cast)
    walk = functools.partial(_walk, t, reaches, inputs, value_of, signature)
    without = walk(False)
    with_writes = walk(True)
    if with_writes is None or (without is not None and (with_writes.nodes, with_writes.earlier, with_writes.values)
                               == (without.nodes, without.earlier, without.values)):
        return without
    with_writes.fallback = without
    return with_writes


def _regenerated_by_its_cast(t: torch.Tensor, inputs: _Inputs) -> bool:
    """Whether ``t`` is a view whose base was written after it was made: eager's ``Module.to``
    reads it after casting the parameters, which regenerates its function from the parameter as
    it is then; the replay cannot tell which ``AccumulateGrad`` that reaches, so it does not guess."""
    node = state_of(t).node
    return is_view(node) and inputs.written.get(storage_root(node), -1) > node.meta["pos"]


def _cast_since(signature: list, cast: AbstractSet[int], itself: bool) -> list:
    """Eager's ``grad_fn`` graph once ``Module.to(dtype)`` ran after construction: a cast
    parameter's ``.data =`` started another ``AccumulateGrad``, so the graph reaches the one left
    behind, and a cast buffer (``itself``) is a ``ToCopyBackward0`` of what it was."""
    out = [("AccumulateGrad", entry[1], False) if entry and entry[0] == "AccumulateGrad" and entry[1] in cast
           and entry[2:] == (True,) else entry for entry in signature]
    if not itself or not out:
        return out
    shifted = [entry if not entry or entry[0] == "AccumulateGrad" else (entry[0], tuple(None if i is None else i + 1 for i in entry[1]))
               for entry in out]
    return [("ToCopyBackward0", (1,)), *shifted]


def _walk(t: torch.Tensor, reaches: list[torch.Tensor], inputs: _Inputs,
          value_of: Callable[[fx.Node, fx.Node], torch.Tensor] | None, signature: list,
          replay_writes: bool) -> Link | None:
    """``_link``'s walk back from ``t``'s node: with ``replay_writes``, the in-place writes
    to each replayed temporary up to its last reader join the ops (ordered by position, they
    write what later readers read, as in eager), and a view or a write passes its reader on to
    the tensor it acts on."""
    mine = [p for p in reaches if is_deferred_tensor(p)]
    mine_ids = {id(inputs.successors.get(id(p), p)) for p in reaches}
    roots = {storage_root(node) for p in mine for node in (state_of(p).node, *state_of(p).former)}
    materialized = {id(p) for p in inputs.parameters.values()}
    needed: dict[fx.Node, None] = {}
    leaves: dict[fx.Node, torch.Tensor] = {}
    earlier: dict[fx.Node, fx.Node] = {}
    values: dict[fx.Node, fx.Node] = {}
    read_until: dict[fx.Node, float] = {}  # replayed temporaries -> the last position they are read at
    end = state_of(t).node
    made = end.meta["pos"]
    todo: list[tuple[fx.Node, fx.Node | None]] = [(end, None)]
    while todo:
        while todo:
            node, reader = todo.pop()
            passes = replay_writes and (is_view(node) or writes_first_argument(node))  # acts on its first argument
            if node in read_until:  # a replayed temporary or a copied constant, read again
                read_until[node] = max(read_until[node], _position(reader))
                continue
            if node in needed:
                if passes:
                    todo.append((node.args[0], reader))
                continue
            if node in leaves or node in values:
                continue
            # written after eager's op read it (the kept tensor itself: ``overwritten``)
            stale = reader is not None and inputs.written.get(storage_root(node), -1) > reader.meta["pos"]
            param = _as_parameter(node, mine)
            then = param is not None and (stale or node is not state_of(param).node  # written or rebound since
                                          or id(param) in inputs.cast)
            if param is not None and id(param) in inputs.successors:  # made real since: rebound
                param, then = inputs.successors[id(param)], True
            if param is not None and (not then or id(param) in materialized):
                if then and value_of is None:
                    return None
                leaves[node] = param
                if then:  # (read by ``t`` itself, a view of it: its value now, after every write)
                    earlier[node] = reader if reader is not None else max(
                        inputs.writes.get(storage_root(node), [node]), key=lambda w: w.meta["pos"])
                continue
            if node in inputs.held and not stale and node is not end:  # (``t`` itself: an alias of it is held,
                leaves[node] = inputs.held[node]                         # ``Parameter(t, requires_grad=False)``)
                continue
            if replay_writes and node.op == "get_attr" and node.target in inputs.constants \
                    and node.target not in inputs.lifted and storage_root(node) in inputs.written:
                leaves[node] = inputs.constants[node.target]  # (copied for each run: its writes run again)
                read_until[node] = _position(reader)
                continue
            if node.op == "get_attr" and node.target in inputs.constants and storage_root(node) not in inputs.written:
                leaf = inputs.constants[node.target]
                if node.target in inputs.lifted:  # a copy of a real tensor that gradients pass in eager
                    leaf = _lifted_leaf(inputs, node.target, mine_ids)
                    if leaf is None:  # eager's graph passes it, the recorded one does not reach its leaves
                        return None   # (``_lifted_leaf``): no graph rebuilt from it can be eager's
                leaves[node] = leaf
                continue
            if not _replayable(node, inputs, stale, replay_writes):
                if value_of is None or reader is None or storage_root(node) in roots:  # a parameter's storage,
                    return None                                                         # not read as the parameter
                values[node] = reader  # no gradient passes it: eager's graph (signature) says so
                continue
            if len(needed) >= _MAX_OPS:
                return None
            needed[node] = None
            if replay_writes and storage_root(node) is node:
                read_until[node] = _position(reader)
            for i, x in enumerate(node.all_input_nodes):
                if passes and i == 0:  # a view or a write is read where its reader reads it
                    todo.append((x, reader))
                else:  # the op that reads its inputs' data: this one, or for ``zeros_like`` the one reading it
                    todo.append((x, reader if reads_no_data(node) and reader is not None else node))
        for root, until in read_until.items():  # the writes before each temporary's last reader
            itself = until == float("inf")
            if itself:  # ``t`` itself: writes under no_grad after its last one with autograd on
                until = _last_graded_write(inputs.writes.get(root, ()), root) + 1  # are copied in (``overwritten``)
            for w in inputs.writes.get(root, ()):
                # (and a temporary's writes through ``.data`` after: they change what its readers saved, in eager)
                after = not itself and w.meta.get(UNTRACKED) and root is not storage_root(end)
                if root.meta["pos"] < w.meta["pos"] and (w.meta["pos"] < until or after) and w not in needed:
                    if not (writes_first_argument(w) and storage_root(w.args[0]) is root
                            and _replayable(w, inputs, False, True)):
                        return None  # (a random, out= or opaque write: the fallback)
                    todo.append((w, w))
    last = storage_root(end)
    since = made if last not in read_until else _last_graded_write(inputs.writes.get(last, ()), last)
    overwritten = any(w.meta["pos"] > since for w in inputs.writes.get(last, ()))
    if not needed or not any(id(p) in materialized for p in leaves.values()):
        return None
    return Link(t, sorted(needed, key=lambda n: n.meta["pos"]), leaves, earlier, values, signature, value_of,
                overwritten=overwritten, result=end, written=frozenset(n for n in leaves if n in read_until))


def _last_graded_write(writes: Any, root: fx.Node) -> int:
    """The position of the last of ``writes`` that autograd saw (else ``root``'s)."""
    return max((w.meta["pos"] for w in writes if not (w.meta.get("no_grad") or w.meta.get(UNTRACKED))),
               default=root.meta["pos"])


def _position(reader: fx.Node | None) -> float:
    """Where ``reader`` reads (None: the kept tensor itself, read from now on)."""
    return float("inf") if reader is None else reader.meta["pos"]


def _replayable(node: fx.Node, inputs: _Inputs, stale: bool, replay_writes: bool) -> bool:
    """``node`` runs again to eager's value: a recorded op that draws nothing, reads what it read
    (not written since, unless its writes run again too), and writes nothing (but for the writes
    that run again)."""
    if node.op != "call_function" or node.meta.get("generators"):
        return False
    if replay_writes:
        return (not node.meta.get("mutates") or writes_first_argument(node)) and bool(
            node.all_input_nodes or getattr(node.target, "overloadpacket", None) in _VALUE_FACTORIES)
    return not node.meta.get("mutates") and (not stale or is_view(node)) and bool(node.all_input_nodes or (
        getattr(node.target, "overloadpacket", None) in _VALUE_FACTORIES and node not in inputs.written))


def _lifted_leaf(inputs: _Inputs, target: str, reached: AbstractSet[int]) -> torch.Tensor | None:
    """The real tensor that requires grad whose value the constant ``target`` copied (a caller's
    tensor, a real parameter or a view of one), where eager's ``grad_fn`` reaches the leaves it
    leads to (``reached``, by ``id``)."""
    real = inputs.lifted.get(target)
    if real is None:
        return None
    leaves = [real] if real.grad_fn is None else autograd_leaves(real)
    return real if leaves and all(id(p) in reached for p in leaves) else None


def _as_parameter(node: fx.Node, params: Any) -> torch.Tensor | None:
    """The parameter among ``params`` that ``node`` stands for: its node now, or one it held
    before ``.data =`` rebound it (an in-place write keeps a tensor's node; a view is another)."""
    for p in params:
        if node is state_of(p).node or node in state_of(p).former:
            return p
    return None


#: Ops without tensor inputs that run again to the same values (``empty`` does not).
_VALUE_FACTORIES = frozenset(getattr(torch.ops.aten, name) for name in (
    "full", "zeros", "ones", "arange", "linspace", "logspace", "eye", "scalar_tensor"))
