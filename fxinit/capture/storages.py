"""The storages a trace has seen: an id each (what slicing follows through views and
in-place writes) and, for small ones, an exact shadow value (``capture.shadows``)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._C import TensorBase
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched


def _untyped_storage_key(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return TensorBase.untyped_storage(t)._cdata


#: The address of a tensor's storage: torch's own accessor skips building a storage object.
storage_key: Callable[[torch.Tensor], int] = getattr(torch._C, "_storage_id", _untyped_storage_key)


@functools.cache
def _references_counted() -> bool:
    """Whether this torch counts a storage's references as ``storage_references`` reads them:
    one for its Python storage object, one for each tensor over it."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None or not hasattr(torch.Tensor, "_use_count"):
        return False
    t = FACTORIES.empty(2, device="meta")
    held = TensorBase.untyped_storage(t)  # as a trace's record of a storage holds it
    alone = count(storage_key(t))
    alias = t.detach()
    counts = (alone, count(storage_key(t)))
    del held, alias
    return counts == (2, 3)


def storage_references(t: torch.Tensor) -> int | None:
    """How many references ``t``'s storage has now: one from each tensor over it (views and
    aliases included) and one from each Python storage object of it (a trace's record holds
    one); None where this torch does not count them so."""
    return torch._C._storage_Use_Count(storage_key(t)) if _references_counted() else None


class StorageInfo:
    """One (meta) storage: an id for slicing and an optional exact shadow value."""

    __slots__ = ("sid", "keepalive", "shadow")

    def __init__(self, sid: int, keepalive: Any) -> None:
        self.sid = sid
        self.keepalive = keepalive
        self.shadow: torch.Tensor | None = None  # flat real CPU tensor over the whole storage


class Storages:
    """Storage ids by storage, numbered in the order the trace first saw them."""

    def __init__(self) -> None:
        self.by_key: dict[int, StorageInfo] = {}  # by ``storage_key``

    def info(self, t: torch.Tensor) -> StorageInfo:
        """``t``'s storage's record, made the first time the storage is seen."""
        key = storage_key(t)
        info = self.by_key.get(key)
        if info is None:
            with torch._C.DisableTorchFunctionSubclass():
                st = TensorBase.untyped_storage(t)
            info = StorageInfo(len(self.by_key), st)  # kept alive: its key is never reused
            self.by_key[key] = info
        return info
