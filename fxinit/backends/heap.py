"""Giving freed heap memory back to the operating system while a plan runs.

glibc's malloc keeps memory freed in the middle of its heaps (blocks under its mmap
threshold, which grows to 32 MiB as large blocks are freed) for later allocations of the
process. A run that computes a full tensor, copies a rank's shard out of it and frees it, a
few hundred times, can leave hundreds of MiB resident that nothing uses (measured: a rank of
a 2 x 2 mesh holding 1.45x its shards). ``malloc_trim`` hands free pages back, but each page
handed back is faulted in again by the next allocation that uses it (trimming after every
group: 1.01x, but 30-45% slower), so ``HeapWatch`` trims only once the process holds more
than ``SLACK`` bytes beyond what it had and what the run has kept (1.04-1.26x, as fast).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
import threading
from typing import Any, Callable, Iterable

import torch

SLACK = 256 << 20  # resident bytes nothing uses that a run may leave before it trims


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapWatch:
    """Trims the C heap when a run has left more than ``slack`` free bytes resident: call
    ``kept(values)`` with each group's kept values as the group ends."""

    def __init__(self, slack: int = SLACK) -> None:
        self.enabled = _malloc_trim() is not None and resident_bytes() > 0
        self.slack = slack
        self.base = resident_bytes() if self.enabled else 0
        self.held = 0  # bytes of the values the run keeps (CPU storages)
        self.seen: set[int] = set()
        # bytes the run may still allocate before free memory could pass ``slack``: reading
        # the resident size (a file read) after every small group cost more than the group
        self.budget = 0
        self._lock = threading.Lock()

    def kept(self, values: Iterable[Any], allocated: int | None = None) -> None:
        """A group ended keeping ``values``, having allocated ``allocated`` bytes (None: unknown)."""
        if not self.enabled:
            return
        with self._lock:
            for v in values:
                if isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    storage = v.untyped_storage()
                    if storage.data_ptr() not in self.seen:
                        self.seen.add(storage.data_ptr())
                        self.held += storage.nbytes()
            if allocated is not None:
                self.budget -= allocated
                if self.budget > 0:
                    return
            unused = resident_bytes() - self.base - self.held
            if unused > self.slack:
                _malloc_trim()(0)  # type: ignore[misc]
                # what trimming could not give back is the new base: trim again only after
                # another ``slack`` bytes
                self.base = resident_bytes() - self.held
                unused = 0
            self.budget = self.slack - unused
