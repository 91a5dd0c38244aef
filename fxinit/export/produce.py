"""Computing the pieces of an export ahead of the writer, with bounded memory.

Worker threads compute batches of pieces in the order they will be written (torch's
kernels and fxinit's fills release the GIL, so they use every core while the writer's
thread waits on the disk). A batch is submitted only while the bytes computed and not yet
written stay under a budget, so memory is bounded whatever the model's size.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

import torch

from fxinit.export.source import Piece

Batch = tuple[Piece, ...]


def batches(pieces: Sequence[Piece], batch_bytes: int) -> list[Batch]:
    """Consecutive pieces grouped into batches of at most ``batch_bytes`` (a larger piece
    alone): many small tensors are computed by one call, a large one by itself."""
    out: list[Batch] = []
    current: list[Piece] = []
    size = 0
    for p in pieces:
        if current and size + p.nbytes > batch_bytes:
            out.append(tuple(current))
            current, size = [], 0
        current.append(p)
        size += p.nbytes
    if current:
        out.append(tuple(current))
    return out


class Producer:
    """Iterates ``(piece, value)`` in the order of ``batches``, computing ahead on
    ``workers`` threads while at most ``budget`` bytes are computed and not yet taken
    (at least one batch is always under way)."""

    def __init__(self, compute: Callable[[Batch], list[torch.Tensor]], batches: Sequence[Batch], budget: int,
                 workers: int) -> None:
        self._compute = compute
        self._batches = list(batches)
        self._budget = budget
        self._workers = max(1, workers)
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[tuple[Piece, torch.Tensor]]:
        pending: deque[tuple[Batch, Future]] = deque()
        todo = iter(self._batches)
        upcoming: list[Batch] = []
        in_flight = 0
        pool = ThreadPoolExecutor(self._workers, "fxinit-export")

        def submit() -> None:
            nonlocal in_flight
            while True:
                if not upcoming:
                    nxt = next(todo, None)
                    if nxt is None:
                        return
                    upcoming.append(nxt)
                size = sum(p.nbytes for p in upcoming[0])
                if pending and (in_flight + size > self._budget or len(pending) >= 4 * self._workers):
                    return
                batch = upcoming.pop()
                pending.append((batch, pool.submit(self._run, batch)))
                in_flight += size

        try:
            submit()
            while pending:
                batch, future = pending.popleft()
                values = future.result()
                for piece, value in zip(batch, values):
                    yield piece, value
                del values
                in_flight -= sum(p.nbytes for p in batch)
                submit()
        finally:
            self._closed.set()
            pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, batch: Batch) -> list[torch.Tensor]:
        if self._closed.is_set():
            return []
        return self._compute(batch)
