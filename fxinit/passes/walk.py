"""Graph walking shared by the passes: who uses a value, and which nodes are views of it."""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

aten = torch.ops.aten

# Ops whose results are views: they read no data.
_VIEWS = {aten.split, aten.split_with_sizes, aten.chunk, aten.slice, aten.narrow, aten.select, aten.view,
          aten._unsafe_view, aten.detach, aten.alias, aten.t, aten.transpose, aten.permute, aten.unsqueeze,
          aten.squeeze, aten.as_strided, aten.expand, aten.unflatten, aten.flatten, aten.unbind}

# Ops that read only the shape, dtype and device of their tensor argument.
_METADATA_ONLY = {aten.new_zeros, aten.new_empty, aten.new_ones, aten.new_full, aten.new_empty_strided,
                  aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like}

Users = Mapping[fx.Node, Sequence[fx.Node]]


def reads_no_data(n: fx.Node) -> bool:
    """Whether ``n`` reads only the metadata of its tensor argument (``empty_like``, ``new_zeros``...)."""
    return getattr(n.target, "overloadpacket", None) in _METADATA_ONLY


def is_view(n: fx.Node) -> bool:
    if n.target is operator.getitem:
        return True
    return getattr(n.target, "overloadpacket", None) in _VIEWS


def users_of(nodes: Sequence[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """``{node: the nodes of ``nodes`` that take it as an input}``, in program order."""
    users: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        for inp in n.all_input_nodes:
            users[inp].append(n)
    return users


def view_closure(n: fx.Node, users: Users, is_alias: Callable[[fx.Node], bool] = is_view) -> set[fx.Node]:
    """``n`` and every node that ``is_alias`` says is a view of it, transitively."""
    seen, stack = {n}, [n]
    while stack:
        for u in users.get(stack.pop(), ()):
            if u not in seen and is_alias(u):
                seen.add(u)
                stack.append(u)
    return seen
