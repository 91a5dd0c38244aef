"""The CPU fill kernels' threads: one pool, and a table of fills split across it.

The kernels are C called through ctypes, which lets go of the GIL for the call: jobs given to
the pool's threads run at once. A fill large enough is cut into jobs that start from jumped
generator states (``rng.fills``); a table of small fills (``rng.fills.native_fill_batch``,
``rng.portable.fill_batch``: a model's hundreds of small tensors) is cut between fills into
ranges of about equal elements, one kernel call each (``table_ranges``, ``run_ranges``). Every
fill writes its own memory from its own state, so the bits do not depend on the cut.

>>> table_ranges([10, 10, 10, 10], threads=2, min_elements=5)
[(0, 2), (2, 4)]
>>> table_ranges([10, 10, 10, 10], threads=2, min_elements=100)  # too small to share out
[(0, 4)]
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:
    """A forked child has the pool object but none of its threads: it makes its own."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def pool() -> ThreadPoolExecutor:
    """The pool that runs fill kernels beside the calling thread."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="fxinit-fill")
        return _POOL


def table_ranges(sizes: Sequence[int], threads: int, min_elements: int) -> list[tuple[int, int]]:
    """Contiguous ranges ``(lo, hi)`` of a table of fills of ``sizes`` elements, about equal in
    elements, at most ``threads`` of them and none under ``min_elements`` (below that a thread
    costs more than it saves)."""
    total = sum(sizes)
    parts = max(1, min(threads, len(sizes), total // max(1, min_elements)))
    if parts == 1:
        return [(0, len(sizes))]
    ranges, lo, done = [], 0, 0
    for i, n in enumerate(sizes):
        done += n
        if done * parts >= total * (len(ranges) + 1) and len(ranges) < parts - 1:
            ranges.append((lo, i + 1))
            lo = i + 1
    return ranges + [(lo, len(sizes))] if lo < len(sizes) else ranges


def run_ranges(call: Callable[[int, int], int], ranges: list[tuple[int, int]]) -> int:
    """``call(lo, hi)`` (how many fills of ``lo .. hi`` it did, counted from ``lo``) for every
    range, the first on the calling thread and the others on the pool; how many fills of the
    whole table are done counted from the first (a range that stops early stops the count)."""
    futures = [pool().submit(call, lo, hi) for lo, hi in ranges[1:]]
    counts = [call(*ranges[0])] + [f.result() for f in futures]
    for (lo, hi), done in zip(ranges, counts):
        if done < hi - lo:
            return lo + done
    return ranges[-1][1] if ranges else 0
