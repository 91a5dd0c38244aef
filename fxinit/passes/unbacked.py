"""Unbacked storages: allocations of a plan no element of which is read or written.

A rank's shard drawn straight from the fill it is cut from (``plan.forwards``) leaves the full
tensor, and the tensor-parallel chunk cloned from it, with nothing to hold: the fill fills no
piece, the copies copy nothing. Allocating them anyway costs the full tensor's memory on a GPU
until its group ends (a CPU never touches those pages). Such an allocation runs as a meta
tensor of its spec instead: its views are views, and an op that reads only its metadata
(``empty_like``, ``new_zeros``) is given the device the allocation was meant for
(``Interpreter.call_function``).

The decision is conservative: every node that takes the storage (or a view of it) must be a
view, a random fill that fills no piece of it, a copy that copies nothing out of or into it
(and draws nothing into it), or a metadata-only op; anything else keeps the allocation.
"""

from __future__ import annotations

from typing import AbstractSet, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import ALLOCATIONS, filled_argument, is_random, is_view, reads_no_data
from fxinit.passes.fills import Ranges
from fxinit.passes.walk import users_of, view_closure

aten = torch.ops.aten


def unbacked_allocations(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node], pieces: Mapping[fx.Node, Ranges],
                         copies: Mapping[fx.Node, Ranges], forwards: AbstractSet[fx.Node]) -> frozenset[fx.Node]:
    """The allocations of the slice ``nodes`` that no element of is read or written, given the
    plan's ``pieces`` (fills restricted to ranges), ``copies`` (copies restricted to ranges)
    and the copies that draw into their output (``forwards``)."""
    users = users_of(nodes)
    out = set()
    for n in nodes:
        if n in keep or n.op != "call_function" or n.meta.get("spec") is None:
            continue
        if not (n.target in ALLOCATIONS or (copies.get(n) == [] and n not in forwards
                                            and n.target is not aten.copy_.default)):
            continue
        closure = view_closure(n, users)
        if closure & keep:
            continue
        if all(_writes_and_reads_nothing(u, closure, pieces, copies, forwards)
               for v in closure for u in users.get(v, ()) if u not in closure):
            out.add(n)
    return frozenset(out)


def _writes_and_reads_nothing(u: fx.Node, closure: AbstractSet[fx.Node], pieces: Mapping[fx.Node, Ranges],
                              copies: Mapping[fx.Node, Ranges], forwards: AbstractSet[fx.Node]) -> bool:
    """Whether ``u``, which takes a node of ``closure`` (an allocation and its views), neither
    reads nor writes any element of it."""
    if u.op == "call_function" and is_view(u):
        return True
    if reads_no_data(u):
        return not is_random(u)  # rand_like and randn_like fill their own new tensor: not from a stand-in
    if is_random(u):
        index = filled_argument(u)
        target = u.args[index] if index is not None and len(u.args) > index else None
        others = [a for a in u.all_input_nodes if a is not target]
        return pieces.get(u) == [] and target in closure and not any(a in closure for a in others)
    if copies.get(u) != []:
        return False
    if u.target is aten.copy_.default:  # into the closure: only if it draws nothing there either
        return not (u.args[0] in closure and u in forwards)
    return u.target is not aten.constant_pad_nd.default  # clone, _to_copy of nothing: their output is theirs
