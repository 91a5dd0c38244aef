"""Graph walking shared by the passes: who uses a value, and which nodes are views of it."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Mapping, Sequence

import torch.fx as fx

from fxinit.ops import is_view

Users = Mapping[fx.Node, Sequence[fx.Node]]


def users_of(nodes: Sequence[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """``{node: the nodes of ``nodes`` that take it as an input}``, in program order."""
    users: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        for inp in n._input_nodes:
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
