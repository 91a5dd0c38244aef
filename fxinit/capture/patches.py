"""Patches to torch that are in place only while a capture is on.

Some doors into a capture are functions or classes of torch that no mode sees (torch's foreach
grouping, storage methods, the legacy typed classes): fxinit replaces them for the capture's
time. One patch serves nested captures and captures in several threads at once: installed on
the first entry, removed on the last exit.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


class WhileCapturing:
    """``install()`` on entering the first capture, ``uninstall()`` on leaving the last one."""

    def __init__(self, install: Callable[[], None], uninstall: Callable[[], None]) -> None:
        self._install, self._uninstall = install, uninstall
        self._lock = threading.Lock()
        self._entered = 0  # captures under way, in any thread

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if not self._entered:
                self._install()
            self._entered += 1
        try:
            yield
        finally:
            with self._lock:
                self._entered -= 1
                if not self._entered:
                    self._uninstall()
