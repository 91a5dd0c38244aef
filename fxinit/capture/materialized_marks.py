"""Which real tensors hold the value a materialize call gave them, and from which trace.

``init_graph`` leaves out what its own trace materialized (the part still to do) and carries
what another trace materialized as data; ``reachable.left_behind`` does not count the meta
tensors materialize made meta because model code built them there. Both ask this registry.

The marks are kept beside the tensors, not on them:

* not in the tensor's ``__dict__``: code copies a parameter's ``__dict__`` into a constructor's
  keyword arguments (bitsandbytes through transformers and accelerate:
  ``Params4bit(value, **old.__dict__)``), and ``torch.save`` of a module pickles it, so a
  stale mark could name a trace of another process;
* without a weak reference to the tensor, Python's or C++'s: ``torch.utils.swap_tensors``
  refuses a tensor that has one (``Module.to_empty`` and ``_apply`` with swapping on).

A mark is keyed by the tensor's ``TensorImpl`` (which ``swap_tensors`` moves with the value)
and lives as long as the storage it was made on, through a weak reference to that storage's
Python object (torch keeps one object per storage while the storage lives). ``t.data = other``
gives the tensor another storage: fxinit's ``Tensor.data`` setter marks it again there
(``Module._apply`` converts parameters so), as the tensor keeps its class and hooks.

    >>> import torch
    >>> t = torch.zeros(2)
    >>> mark(t, 7); trace_serial(t)
    7
    >>> unmark(t); trace_serial(t) is None
    True
"""

from __future__ import annotations

import itertools
import weakref

import torch

TRACE_SERIALS = itertools.count(1)  # one per recorder (``Recorder.serial``), which marks name
#: id of a storage's Python object -> (a weak reference to it, {TensorImpl address: trace serial})
_MARKS: dict[int, tuple[weakref.ref, dict[int, int]]] = {}


def _place(t: torch.Tensor) -> tuple[torch.UntypedStorage | None, int]:
    """The storage ``t``'s values live in (a sparse tensor's: its values'), if it has one, and
    its ``TensorImpl``'s address; asked without running a subclass's ``__torch_function__``,
    which eager would not have run."""
    with torch._C.DisableTorchFunctionSubclass():
        impl = t._cdata
        try:
            if t.layout == torch.sparse_coo:
                return t._values().untyped_storage(), impl
            if t.layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
                return t.values().untyped_storage(), impl
            return t.untyped_storage(), impl
        except (RuntimeError, NotImplementedError, TypeError):  # (wrapper subclasses, nested tensors)
            return None, impl


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _MARKS.get(key)
    if entry is not None and entry[0] is ref:
        del _MARKS[key]


def mark(t: torch.Tensor, serial: int | None) -> None:
    """Record that ``t`` holds the value materialize gave it for trace ``serial`` (None: no
    trace's). A tensor without a storage fxinit can see (a wrapper subclass) stays unmarked:
    it counts as data."""
    storage, impl = _place(t)
    if storage is None or serial is None:
        return
    key = id(storage)
    entry = _MARKS.get(key)
    if entry is None or entry[0]() is not storage:
        ref = weakref.ref(storage, lambda r, key=key: _forget(key, r))
        entry = _MARKS[key] = (ref, {})
    entry[1][impl] = serial


def unmark(t: torch.Tensor) -> None:
    """``t`` no longer holds a value materialize gave (it was handed the user's)."""
    storage, impl = _place(t)
    entry = _MARKS.get(id(storage)) if storage is not None else None
    if entry is not None and entry[0]() is storage:
        entry[1].pop(impl, None)


def trace_serial(t: torch.Tensor) -> int | None:
    """The serial of the trace whose materialize gave ``t`` its value (``Recorder.serial``),
    or None for a tensor materialize did not give one."""
    if not _MARKS:  # (``Tensor.data = `` asks on every call: nothing materialized, nothing to look up)
        return None
    storage, impl = _place(t)
    entry = _MARKS.get(id(storage)) if storage is not None else None
    if entry is None or entry[0]() is not storage:
        return None
    return entry[1].get(impl)
