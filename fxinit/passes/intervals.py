"""Sets of storage elements as sorted, disjoint half-open ranges, and how element positions
of one strided view map onto another's.

The read-demand analysis (``passes.demand``) carries "which elements are still needed"
backwards through copies, clones and element-wise ops. A sharded parameter's demand is
often thousands of row pieces (a block of every row of a row-parallel weight); numpy
arrays of shape ``(k, 2)`` keep every set operation linear and vectorized.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, Callable, TypeVar

import numpy as np

from fxinit.ops import per_node

Set = np.ndarray  # int64[k, 2]: sorted, disjoint, non-empty half-open ranges
EMPTY: Set = np.zeros((0, 2), dtype=np.int64)
#: Stands for "every element" where a view's elements are not known.
EVERYTHING: Set = np.array([[0, 1 << 62]], dtype=np.int64)
#: Above this many runs a view's elements are taken as its whole extent.
MAX_RUNS = 1 << 20


F = TypeVar("F", bound=Callable[..., Any])


def memo(fn: F) -> F:
    """``fn`` remembering its last few thousand results. A model repeats its layers, and
    every layer's copies have the same layouts and the same sets: the element analyses
    then cost about one layer's. Arrays among the arguments count by value; the results
    are read-only."""
    cache: OrderedDict[Any, Any] = OrderedDict()
    lock = threading.Lock()

    def frozen(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
        elif isinstance(value, tuple):
            for v in value:
                frozen(v)
        return value

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        k = tuple((a.shape, a.tobytes()) if isinstance(a, np.ndarray) else a for a in args)
        with lock:
            if k in cache:
                cache.move_to_end(k)
                return cache[k]
        value = frozen(fn(*args))
        with lock:
            cache[k] = value
            if len(cache) > 4096:
                cache.popitem(last=False)
        return value

    return wrapper  # type: ignore[return-value]


def of(ranges: list[tuple[int, int]] | np.ndarray) -> Set:
    """The set of ``ranges`` (any order, overlaps allowed)."""
    a = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    return union(a)


def _one(lo: int, hi: int) -> Set:
    """The set of ``lo .. hi`` (empty when ``hi <= lo``)."""
    return np.array([[lo, hi]], dtype=np.int64) if hi > lo else EMPTY


# One range on each side is the common case (a whole tensor, a row block): plain ints then,
# numpy's per-call cost is most of the work otherwise.
def union(*sets: Set) -> Set:
    """Every element of any of ``sets``."""
    if len(sets) == 2:
        a, b = sets
        if not len(a) or not len(b):  # sets are never written: the other one serves as it is
            return b if len(b) else a
        if len(a) == 1 and len(b) == 1:
            (a0, a1), (b0, b1) = a[0].tolist(), b[0].tolist()
            if a1 > a0 and b1 > b0 and a0 <= b1 and b0 <= a1:
                return _one(min(a0, b0), max(a1, b1))
    a = np.concatenate([s for s in sets if len(s)]) if any(len(s) for s in sets) else EMPTY
    a = a[a[:, 1] > a[:, 0]]
    if len(a) <= 1:
        return a.copy()
    a = a[np.argsort(a[:, 0], kind="stable")]
    ends = np.maximum.accumulate(a[:, 1])
    starts_new = np.ones(len(a), dtype=bool)
    starts_new[1:] = a[1:, 0] > ends[:-1]
    first = np.flatnonzero(starts_new)
    last = np.append(first[1:], len(a)) - 1
    return np.stack([a[first, 0], ends[last]], axis=1)


def intersect(a: Set, b: Set) -> Set:
    """The elements in both ``a`` and ``b``."""
    if not len(a) or not len(b):
        return EMPTY
    if len(a) == 1 and len(b) == 1:
        (a0, a1), (b0, b1) = a[0].tolist(), b[0].tolist()
        return _one(max(a0, b0), min(a1, b1))
    # for each range of b, the ranges of a that overlap it
    lo_idx = np.searchsorted(a[:, 1], b[:, 0], side="right")
    hi_idx = np.searchsorted(a[:, 0], b[:, 1], side="left")
    counts = np.maximum(hi_idx - lo_idx, 0)
    if not counts.sum():
        return EMPTY
    total = int(counts.sum())
    which_b = np.repeat(np.arange(len(b)), counts)
    first = np.cumsum(counts) - counts
    which_a = np.arange(total) - np.repeat(first, counts) + np.repeat(lo_idx, counts)
    lo = np.maximum(a[which_a, 0], b[which_b, 0])
    hi = np.minimum(a[which_a, 1], b[which_b, 1])
    keep = hi > lo
    return np.stack([lo[keep], hi[keep]], axis=1)


def subtract(a: Set, b: Set) -> Set:
    """The elements of ``a`` not in ``b``."""
    if not len(a) or not len(b):
        return a
    if len(a) == 1 and len(b) == 1:
        (a0, a1), (b0, b1) = a[0].tolist(), b[0].tolist()
        if b1 <= a0 or a1 <= b0:
            return a
        left, right = (a0, min(a1, b0)), (max(a0, b1), a1)
        kept = [r for r in (left, right) if r[1] > r[0]]
        return np.array(kept, dtype=np.int64) if kept else EMPTY
    # the complement of b, clipped to a's span, intersected with a
    lo, hi = min(a[0, 0], b[0, 0]), max(a[-1, 1], b[-1, 1])
    gaps = np.stack([np.concatenate([[lo], b[:, 1]]), np.concatenate([b[:, 0], [hi]])], axis=1)
    return intersect(a, gaps[gaps[:, 1] > gaps[:, 0]])


def size(a: Set) -> int:
    return int((a[:, 1] - a[:, 0]).sum()) if len(a) else 0


def as_list(a: Set) -> list[tuple[int, int]]:
    return [(int(lo), int(hi)) for lo, hi in a]


@memo
def elements(spec) -> tuple[Set, bool]:  # noqa: ANN001
    """The storage elements a strided view covers, and whether that is exact (a view of
    more than ``MAX_RUNS`` runs, or a negative stride, is taken as its whole extent)."""
    if spec is None:
        return EVERYTHING, False
    if any(n == 0 for n in spec.shape):
        return EMPTY, True
    found = runs(spec.shape, [(st,) for st in spec.stride], spec.storage_offset)
    if found is not None:
        starts, run = found
        return union(np.stack([starts[:, 0], starts[:, 0] + run], axis=1)), True
    if any(st < 0 for st in spec.stride):
        return EVERYTHING, False
    last = spec.storage_offset + sum((n - 1) * st for n, st in zip(spec.shape, spec.stride))
    return np.array([[spec.storage_offset, last + 1]], dtype=np.int64), False


@per_node
def elements_of(node: Any) -> tuple[Set, bool]:
    """``elements`` of an fx node's spec."""
    return elements(node.meta.get("spec"))


def runs(shape, strides: list[tuple[int, ...]], *offsets: int) -> tuple[np.ndarray, int] | None:  # noqa: ANN001
    """Runs of positions contiguous in every view at once: ``(starts[k, views], length)``.

    ``strides[d]`` holds dimension ``d``'s stride in each view. Dimensions of size one
    drop out; the innermost dimensions merge while every view continues them contiguously."""
    dims = [(n, st) for n, st in zip(shape, strides) if n != 1]
    if any(s < 0 for _, st in dims for s in st):
        return None
    dims.sort(key=lambda d: d[1])
    run, inner = 1, 0
    while inner < len(dims) and all(s == run for s in dims[inner][1]):
        run *= dims[inner][0]
        inner += 1
    outer = dims[inner:]
    count = 1
    for n, _ in outer:
        count *= n
    if count > MAX_RUNS:
        return None
    starts = np.array([offsets], dtype=np.int64)
    for n, st in outer:
        step = np.arange(n, dtype=np.int64)[:, None] * np.array(st, dtype=np.int64)[None, :]
        starts = (starts[:, None, :] + step[None, :, :]).reshape(-1, len(offsets))
    return starts, run


@memo
def carry(demand: Set, dst, src) -> Set | None:  # noqa: ANN001
    """The elements of ``src``'s storage at the positions where ``dst`` (a view of the same
    shape) holds ``demand``'s elements: what a copy from ``src`` into ``dst`` must read for
    ``demand`` to be right. None where the two layouts are not followed (the caller then
    takes all of ``src``)."""
    if dst is None or src is None or tuple(dst.shape) != tuple(src.shape):
        return None
    if not len(demand) or any(n == 0 for n in dst.shape):
        return EMPTY
    moves = correspondence(demand, tuple(dst.shape), dst.stride, src.stride, dst.storage_offset, src.storage_offset)
    return None if moves is None else union(moves[0] + moves[1][:, None])


@memo
def correspondence(demand: Set, shape, dst_stride, src_stride, dst_offset: int, src_offset: int  # noqa: ANN001
                   ) -> tuple[Set, np.ndarray] | None:
    """The elements of ``demand`` a view of ``shape`` (``dst_*``) holds, cut where another
    view of the same shape (``src_*``) stops being contiguous with it, and for each piece the
    shift from dst's storage element to src's at the same position. None where the layouts
    are not followed or dst overlaps itself (a broadcast: positions are not one-to-one)."""
    found = runs(shape, list(zip(dst_stride, src_stride)), dst_offset, src_offset)
    if found is None:
        return None
    starts, run = found
    d, s = starts[:, 0], starts[:, 1]
    if len(d) > 1 and not (d[1:] > d[:-1]).all():
        order = np.argsort(d, kind="stable")
        d, s = d[order], s[order]
    if len(d) > 1 and not (d[1:] >= d[:-1] + run).all():
        return None  # dst overlaps itself
    pieces = intersect(demand, np.stack([d, d + run], axis=1))  # dst runs: sorted, disjoint
    which = np.searchsorted(d, pieces[:, 0], side="right") - 1
    return pieces, s[which] - d[which]
