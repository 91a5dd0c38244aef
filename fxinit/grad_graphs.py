"""Reading autograd graphs: the leaves a ``grad_fn`` leads to, the tensors it holds, and the
graph's shape as data.

``fxinit.autograd_links`` rebuilds tensors that eager computed from parameters with autograd
on; these say which parameters such a tensor reaches and whether a rebuilt ``grad_fn`` graph
is eager's (``graph_signature`` of each, compared by ``signatures_match``).
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import AbstractSet, Any, Callable, Iterable

import torch

from fxinit.capture.lifted import LIFTED_WITH_GRAD


def autograd_leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors ``t``'s ``grad_fn`` leads to (the parameters it was computed from)."""
    return _over_graph(t, lambda fn: (getattr(fn, "variable", None),))  # AccumulateGrad's


def held_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors ``t``'s ``grad_fn`` graph holds: its leaves, and the tensors its functions
    saved for the backward (a pruned weight's mask, ``w * mask``'s ``other``) or keep as
    attributes (a custom ``autograd.Function``'s ``ctx.x = x``). Each of them has a reference
    more while the graph lives, which ``torch.utils.swap_tensors`` refuses."""
    return _over_graph(t, _held_by)


def _over_graph(t: torch.Tensor, found: Callable[[Any], Iterable[Any]]) -> list[torch.Tensor]:
    """The tensors ``found`` finds at each function of ``t``'s ``grad_fn`` graph, each once."""
    out: dict[int, torch.Tensor] = {}
    seen: dict[int, Any] = {}  # the functions too: a freed wrapper's id is another's (torch 2.11, 2.12)
    todo = [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for x in found(fn):
            if isinstance(x, torch.Tensor):
                out.setdefault(id(x), x)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return list(out.values())


def _held_by(fn: Any) -> list[Any]:
    """What one autograd function holds, tensors among it (see ``held_tensors``)."""
    values: list[Any] = [getattr(fn, "variable", None)]  # AccumulateGrad
    for name in _saved_names(type(fn)):
        try:
            values.append(getattr(fn, name))
        except RuntimeError:  # freed by a backward already
            continue
    if isinstance(fn, torch.autograd.function.BackwardCFunction):
        with contextlib.suppress(RuntimeError):
            values.extend(fn.saved_tensors)
        values.extend(vars(fn).values())
    return [x for v in values for x in (v if isinstance(v, (list, tuple)) else (v,))]


@functools.lru_cache(maxsize=None)
def _saved_names(kind: type) -> tuple[str, ...]:
    """The properties of an autograd function's type that unpack a saved value."""
    return tuple(n for n in dir(kind) if n.startswith("_saved_"))


def graph_signature(t: torch.Tensor, rebound: AbstractSet[int] = frozenset()) -> list:
    """The shape of ``t``'s ``grad_fn`` graph, in a size linear in it: each function in the
    order a depth-first walk first meets it, as its kind and the positions of what it leads to
    (a leaf as ``AccumulateGrad`` of its object, and whether it is the one a backward reaches the
    object through now: ``.data =`` of another dtype or device starts another, so a graph made
    before that, unlike a view's function regenerated after, does not reach it), as eager's graph
    has them: through the edges the capture adds to the real tensors it lifts (``_through_lifts``).
    ``rebound``: the ids of leaves whose ``.data`` another dtype or device will replace (a replay
    holding a cast parameter's value then): none of their functions now is the one then."""
    order: dict[int, int] = {}
    out: list = []
    met: list = []  # held until the walk ends, so that no id is reused by another function's wrapper

    def meet(fn: Any) -> Any:
        """Number ``fn`` the first time the walk meets it; a leaf's entry is complete at once."""
        order[id(fn)] = len(out)
        met.append(fn)
        variable = getattr(fn, "variable", None)
        out.append(("AccumulateGrad", id(variable), _reached_now(fn, variable) and id(variable) not in rebound)
                   if isinstance(variable, torch.Tensor) else None)
        return None if isinstance(variable, torch.Tensor) else (fn, iter(fn.next_functions), [])

    # depth first without Python's recursion: a chain of ops as long as a model's init is no limit
    stack = []
    if (fn := _through_lifts(t.grad_fn)) is not None and (first := meet(fn)) is not None:
        stack.append(first)
    while stack:
        fn, successors, positions = stack[-1]
        next_fn = next(successors, False)
        if next_fn is False:
            stack.pop()
            out[order[id(fn)]] = (type(fn).__name__, tuple(positions))
            continue
        next_fn = _through_lifts(next_fn[0])
        if next_fn is None:
            positions.append(None)
        elif id(next_fn) in order:
            positions.append(order[id(next_fn)])
        else:
            positions.append(len(out))
            frame = meet(next_fn)
            if frame is not None:
                stack.append(frame)
    return out


def _through_lifts(fn: Any) -> Any:
    """``fn``, or where it is the edge of a real tensor lifted as a capture's constant
    (``capture.lifted.LIFTED_WITH_GRAD``, not in eager's graph) the function behind it."""
    while fn is not None and type(fn) is LIFTED_WITH_GRAD:
        fn = fn.next_functions[0][0]
    return fn


def _reached_now(accumulate: Any, variable: torch.Tensor) -> bool | None:
    """Whether ``accumulate`` is ``variable``'s gradient edge now (None: it requires no grad now)."""
    if not variable.requires_grad:
        return None
    return torch.autograd.graph.get_gradient_edge(variable).node is accumulate


def signatures_match(replayed: list, recorded: list, reached_now: bool = True) -> bool:
    """The replayed ``grad_fn`` graph is the one the capture recorded, but where a view's
    base was written in place after the view was made: real tensors then regenerate the view's
    function as ``AsStridedBackward0``, which eager's are, and the capture's deferred tensors
    (a subclass: torch replays the view op for those) as the view op's own. Without
    ``reached_now``, whether each leaf's ``AccumulateGrad`` is the one it has now is not compared."""
    if len(replayed) != len(recorded):
        return False
    for got, want in zip(replayed, recorded):
        if not reached_now and got is not None and want is not None and got[0] == want[0] == "AccumulateGrad":
            got, want = got[:2], want[:2]
        if got != want and not (got[0] == "AsStridedBackward0" and got[1] == want[1] and _views(want[0])):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _views(grad_fn_name: str) -> bool:
    """``SliceBackward0`` and the like: the backward of an aten view op."""
    stem = grad_fn_name.removesuffix("Backward0")
    op = getattr(torch.ops.aten, re.sub(r"(?<!^)(?=[A-Z])", "_", stem).lower(), None)
    schemas = [getattr(op, name)._schema for name in op.overloads()] if op is not None else []
    return any(s.returns and s.returns[0].alias_info is not None and not s.returns[0].alias_info.is_write
               for s in schemas)
