"""Origins: which random fill drew each element a copy moves, and at which position.

Between a random fill and the tensor a rank keeps, layout code copies: tensor parallelism
``clone``\\ s its chunk of the full tensor, the scatter ``copy_``\\ s that into the local
tensor, FSDP ``copy_``\\ s a row block of it into a padded buffer. Every one of those copies
writes the shard's bytes again, into fresh pages. Where the elements a copy writes are, all
along the chain, unchanged draws of one fill, the copy can draw them itself, straight into
its destination (``plan.forwards``): exact mode's draws come from a generator snapshot, so
element ``p`` of a fill is the same whenever it is drawn. The fill and the copies before
then have nothing left to do for those elements (``passes.demand``).

This module walks a slice forward, keeping for every storage root (``roots.storage_root``)
the runs of its elements that hold a fill's draws unchanged, as ``Runs``: rows
``(lo, hi, fill, shift)``, storage elements ``lo .. hi`` holding the draws at positions
``lo + shift .. hi + shift`` of fill number ``fill``. Going over a node:

* a whole-storage random fill that can draw any piece alone (``sources``) makes its target's
  elements its own draws;
* ``copy_``, ``clone``, ``_to_copy``, ``lift_fresh_copy`` and ``constant_pad_nd`` (DTensor's
  padding of an uneven shard) between views of the same shape, dtype and device move the runs
  their source holds to their destination's positions (``intervals.correspondence``); other
  elements they write lose their origin;
* any other write loses the origin of every storage it may write; a new storage has none.

Storages that may share memory with another root (``roots.shared_roots``) never have an
origin: a write through the other root would not be seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch
import torch.fx as fx

from fxinit.ops import is_view, reads_no_data
from fxinit.passes import intervals
from fxinit.passes.intervals import Set
from fxinit.passes.roots import filled, reinterprets, storage_root
from fxinit.spec import TensorSpec

aten = torch.ops.aten

Runs = np.ndarray  # int64[k, 4]: lo, hi, fill number, shift; sorted by lo, disjoint
NO_RUNS: Runs = np.zeros((0, 4), dtype=np.int64)

#: Out-of-place ops whose element ``i`` is a copy of their input's element ``i``.
COPIES = frozenset({aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default})


@dataclass
class Origins:
    """What the forward walk found: ``fills`` numbers the fills runs refer to, ``at`` maps
    each copy to the runs of its destination's storage it wrote with a fill's draws."""

    fills: list[fx.Node] = field(default_factory=list)
    at: dict[fx.Node, Runs] = field(default_factory=dict)


def copy_origins(nodes: Sequence[fx.Node], sources: Callable[[fx.Node], bool],
                 shared: AbstractSet[fx.Node], read: Mapping[fx.Node, Set] | None = None) -> Origins:
    """The origins of what the copies of the slice ``nodes`` (program order) write.
    ``sources(fill)``: whether a whole-storage fill can draw pieces alone; ``shared``: storage
    roots that may alias another (``roots.shared_roots``); ``read``: for copies, the elements
    of their output read later (``demand.Demand.copies``), the only ones worth following (a
    row-parallel weight's TP chunk has thousands of rows, of which a rank reads a few)."""
    found = Origins()
    number: dict[fx.Node, int] = {}
    held: dict[fx.Node, Runs] = {}
    for n in nodes:
        if n.op == "call_function" and is_view(n):
            continue
        if n.op != "call_function" or reads_no_data(n):
            held.pop(n, None)
            continue
        target = filled(n) if n.meta.get("generators") else None
        if target is not None and n.meta.get("overwrites"):
            root = storage_root(target)
            covered, exact = intervals.elements(target.meta.get("spec"))
            if root in shared or not exact or reinterprets(target):
                held.pop(root, None)
            elif sources(n):
                number.setdefault(n, len(found.fills))
                if number[n] == len(found.fills):
                    found.fills.append(n)
                mine = np.concatenate([covered, np.full((len(covered), 1), number[n]),
                                       np.zeros((len(covered), 1), dtype=np.int64)], axis=1)
                held[root] = assign(held.get(root, NO_RUNS), covered, mine)
            else:
                held[root] = remove(held.get(root, NO_RUNS), covered)
            _lose_other_writes(n, held, skip=target)
            continue
        copy = copied_views(n)
        if copy is not None:
            if copy.reinterpreted:
                held.pop(copy.root, None)
                continue
            covered, exact = intervals.elements(copy.dst)
            followed = intervals.intersect(covered, read[n]) if read is not None and n in read else covered
            moved = _moved(copy, followed, held.get(storage_root(copy.src), NO_RUNS)) if exact else None
            if moved is None or copy.root in shared:
                held.pop(copy.root, None)
                continue
            held[copy.root] = assign(held.get(copy.root, NO_RUNS), covered, moved)
            if len(moved):
                found.at[n] = moved
            continue
        _lose_other_writes(n, held)
        held.pop(n, None)
    return found


class Copied(NamedTuple):
    """What a node that copies elements moves: the elements of view ``src_view`` of ``src``'s
    storage go to the same positions of view ``dst`` of ``root``'s storage. ``reinterpreted``:
    either side views its storage as another dtype (``roots.reinterprets``): positions unknown."""

    root: fx.Node
    dst: TensorSpec
    src: fx.Node
    src_view: TensorSpec
    reinterpreted: bool = False


def copied_views(n: fx.Node) -> Copied | None:
    """What copy ``n`` moves (``copy_``, ``COPIES``, and ``constant_pad_nd`` from its input into
    the unpadded part of its output), or None for other nodes and unknown layouts."""
    if n.target is aten.copy_.default and len(n.args) >= 2 and all(isinstance(a, fx.Node) for a in n.args[:2]):
        dst, src = n.args[0].meta.get("spec"), n.args[1].meta.get("spec")
        if dst is None or src is None:
            return None
        return Copied(storage_root(n.args[0]), dst, n.args[1], src, reinterprets(n.args[0]) or reinterprets(n.args[1]))
    if not n.args or not isinstance(n.args[0], fx.Node) or n.meta.get("spec") is None \
            or n.args[0].meta.get("spec") is None:
        return None
    if n.target in COPIES:
        return Copied(n, n.meta["spec"], n.args[0], n.args[0].meta["spec"], reinterprets(n.args[0]))
    if n.target is aten.constant_pad_nd.default and len(n.args) >= 2:
        padded = _padded(n, n.args[0].meta["spec"], list(n.args[1]))
        return None if padded is None else padded._replace(reinterpreted=reinterprets(n.args[0]))
    return None


def _padded(n: fx.Node, src: TensorSpec, pad: list[int]) -> Copied | None:
    """``constant_pad_nd``: ``pad`` holds (before, after) pairs from the last dimension on;
    a negative one crops the input."""
    out = n.meta["spec"]
    if len(pad) % 2 or len(pad) // 2 > len(src.shape) or len(out.shape) != len(src.shape):
        return None
    dst_off, src_off, shape = out.storage_offset, src.storage_offset, list(src.shape)
    for i in range(len(pad) // 2):
        d = len(shape) - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        dst_off += max(before, 0) * out.stride[d]
        src_off += max(-before, 0) * src.stride[d]
        shape[d] -= max(-before, 0) + max(-after, 0)
    if any(s <= 0 for s in shape):
        return None
    return Copied(n, out._replace(shape=tuple(shape), storage_offset=dst_off), n.args[0],
                  src._replace(shape=tuple(shape), storage_offset=src_off))


def _moved(copy: Copied, covered: Set, held: Runs) -> Runs | None:
    """The runs ``copy``'s source holds, at the positions of its destination they are copied
    to; None where the copy converts (dtype, device) or the layouts are not followed."""
    d, s = copy.dst, copy.src_view
    if d.dtype != s.dtype or d.device != s.device or tuple(d.shape) != tuple(s.shape):
        return None
    if not len(held) or not len(covered):
        return NO_RUNS
    moves = intervals.correspondence(covered, tuple(d.shape), d.stride, s.stride, d.storage_offset, s.storage_offset)
    return None if moves is None else compose(*moves, held)


def _lose_other_writes(n: fx.Node, held: dict[fx.Node, Runs], skip: fx.Node | None = None) -> None:
    """What ``n`` may write loses its origins: the elements of the views it writes (all of
    its inputs' storages where the op does not say what it writes, or writes more storages
    than its schema says, as the capture saw: ``meta["mutates"]``)."""
    schema = getattr(n.target, "_schema", None)
    targets = list(n.all_input_nodes)
    if schema is not None:
        marked = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            marked += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
        if len(set(n.meta.get("mutates", ()))) <= len({storage_root(t) for t in marked}):
            targets = marked
        else:  # running statistics written by batch norm, unannotated
            schema = None
    for t in targets:
        root = storage_root(t)
        if t is skip or root not in held:
            continue
        written, exact = (intervals.elements(t.meta.get("spec")) if schema is not None and not reinterprets(t)
                          else (None, False))
        if exact:
            held[root] = remove(held[root], written)
        else:
            held.pop(root)


# ------------------------------------------------------------------------ runs
def restrict(runs: Runs, elements: Set) -> Runs:
    """The parts of ``runs`` on ``elements``."""
    if not len(runs) or not len(elements):
        return NO_RUNS
    return _annotate(intervals.intersect(runs[:, :2], elements), runs)


def remove(runs: Runs, elements: Set) -> Runs:
    """The parts of ``runs`` off ``elements``."""
    if not len(runs) or not len(elements):
        return runs
    return _annotate(intervals.subtract(runs[:, :2], elements), runs)


def assign(runs: Runs, elements: Set, new: Runs) -> Runs:
    """``runs`` after ``elements`` were overwritten with ``new`` (runs on ``elements``)."""
    kept = remove(runs, elements)
    both = np.concatenate([kept, new]) if len(new) else kept
    return merge(both[np.argsort(both[:, 0], kind="stable")])


def compose(pieces: Set, shifts: np.ndarray, held: Runs) -> Runs:
    """``pieces`` of a destination whose element ``e`` copies source element ``e + shift``,
    mapped through the source's runs ``held``: the destination's runs."""
    if not len(pieces) or not len(held):
        return NO_RUNS
    fills, numbers = np.unique(held[:, 2], return_inverse=True)  # every layer's copies alike
    out = _compose(pieces, shifts, np.concatenate([held[:, :2], numbers.reshape(-1, 1), held[:, 3:]], axis=1))
    return np.concatenate([out[:, :2], fills[out[:, 2]].reshape(-1, 1), out[:, 3:]], axis=1)


@intervals.memo
def _compose(pieces: Set, shifts: np.ndarray, held: Runs) -> Runs:
    order = np.argsort(pieces[:, 0] + shifts, kind="stable")
    shift = shifts[order]
    moved = np.stack([pieces[order, 0] + shift, pieces[order, 1] + shift], axis=1)  # in the source
    both = intervals.intersect(held[:, :2], moved)
    which_piece = np.searchsorted(moved[:, 0], both[:, 0], side="right") - 1
    which_run = np.searchsorted(held[:, 0], both[:, 0], side="right") - 1
    d = shift[which_piece]
    out = np.stack([both[:, 0] - d, both[:, 1] - d, held[which_run, 2], held[which_run, 3] + d], axis=1)
    return merge(out[np.argsort(out[:, 0], kind="stable")])


def merge(runs: Runs) -> Runs:
    """``runs`` with neighbours that continue each other (same fill, same shift) joined."""
    if len(runs) < 2:
        return runs
    joins = (runs[1:, 0] == runs[:-1, 1]) & (runs[1:, 2] == runs[:-1, 2]) & (runs[1:, 3] == runs[:-1, 3])
    if not joins.any():
        return runs
    first = np.flatnonzero(np.concatenate([[True], ~joins]))
    last = np.append(first[1:], len(runs)) - 1
    return np.stack([runs[first, 0], runs[last, 1], runs[first, 2], runs[first, 3]], axis=1)


def _annotate(pieces: Set, runs: Runs) -> Runs:
    """``pieces``, each inside one of ``runs``, with that run's fill and shift."""
    if not len(pieces):
        return NO_RUNS
    which = np.searchsorted(runs[:, 0], pieces[:, 0], side="right") - 1
    return np.concatenate([pieces, runs[which, 2:]], axis=1)
