"""The progress of an export: bytes written, rate and time left, on stderr."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    """Counts bytes as they reach the disk; shows a tqdm bar (bytes, rate, ETA) unless
    ``quiet``."""

    def __init__(self, total: int, quiet: bool, desc: str = "export") -> None:
        self.total = total
        self.written = 0
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._bar = None
        if not quiet and total:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, file=sys.stderr,
                             dynamic_ncols=True, smoothing=0.1)

    def update(self, n: int) -> None:
        with self._lock:
            self.written += n
            if self._bar is not None:
                self._bar.update(n)

    def close(self) -> None:
        """The job is done: the bar ends at what was written (DCP's total is an upper bound:
        the bytes ``torch.save`` adds around each tensor are known only once written)."""
        if self._bar is not None:
            if self._bar.n != self._bar.total:
                self._bar.total = self._bar.n
                self._bar.refresh()
            self._bar.close()
            self._bar = None

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started
