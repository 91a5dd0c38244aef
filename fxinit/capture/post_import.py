"""Run code when someone else imports a module: fxinit imports no ``torch.distributed`` module.

fxinit answers questions that torch.distributed's code asks deferred tensors
(``capture.collectives``, ``fxinit.fsdp1``) and wraps DTensor's constructor
(``capture.dtensor``). Importing those modules from fxinit made ``import fxinit`` import
much of torch.distributed, and made a cycle: FSDP1's ``_init_utils`` imports ``torchdistx``
while it is being imported, and fxinit's torchdistX stand-in (``fxinit.torchdistx``)
imports fxinit, which imported ``_init_utils`` again, half-initialized. Now each of them
registers a callback that runs right after the module's own code has run, whoever imports it.

>>> import sys
>>> from fxinit.capture.post_import import when_imported
>>> when_imported("json", lambda module: print("json is here"))  # already imported: runs now
json is here
"""

from __future__ import annotations

import importlib.machinery
import sys
import threading
import types
from typing import Any, Callable

_CALLBACKS: dict[str, list[Callable[[types.ModuleType], None]]] = {}
_LOCK = threading.RLock()


def _initialized(name: str) -> bool:
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def when_imported(name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """``callback(module)`` once module ``name`` has been imported and run: now if it has,
    else right after whoever imports it."""
    with _LOCK:
        if _initialized(name):
            run_now = True
        else:
            run_now = False
            _CALLBACKS.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
    if run_now:
        callback(sys.modules[name])


def run_pending() -> None:
    """Run the callbacks of watched modules that finished importing without the finder
    seeing them: fxinit itself imported while such a module was being imported (FSDP1's
    ``_init_utils`` importing a ``torchdistx`` that imports fxinit). Cheap when none wait."""
    if not _CALLBACKS:
        return
    for name in [n for n in list(_CALLBACKS) if _initialized(n)]:
        _run(name, sys.modules[name])


def _run(name: str, module: types.ModuleType) -> None:
    with _LOCK:
        callbacks = _CALLBACKS.pop(name, [])
    for callback in callbacks:
        callback(module)


class _Finder:
    """A meta-path finder that finds nothing itself: for a watched module it asks the usual
    path finder and wraps the loader's ``exec_module`` to run the callbacks after it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _CALLBACKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None  # let the usual finders import it; the callbacks run at the next import check
        run_module = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run_module(module)
            _run(name, module)

        loader.exec_module = exec_module
        return spec

    def invalidate_caches(self) -> None:
        pass


_FINDER = _Finder()
