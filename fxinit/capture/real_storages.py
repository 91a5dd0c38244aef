"""Storage methods during capture: real memory, computed with for real.

A storage is never deferred: a deferred tensor has none to give (``untyped_storage()`` is
refused in ``capture.deferred``), so every storage a constructor meets holds real memory (a
caller's tensor's, one ``torch.load`` read, one it allocates itself). Yet torch implements
storage methods with tensor ops: ``UntypedStorage.copy_`` and ``fill_`` in C++ wrap the
storages in tensors built by ``at::empty`` and ``set_``, ``clone`` and ``copy.deepcopy`` of a
tensor go through ``copy_``, and ``TypedStorage``'s element access and casts build
``torch.tensor([]).set_(storage)``. The capture modes would take those ops for the model's
own and record them: the real storage never written, silently (``copy.deepcopy`` of a tensor
handed to the constructor gave uninitialized memory: torchmetrics' ``clone`` of a metric
holding such a buffer, chemprop's ``MPNN``).

While a capture is on, the methods of ``torch.UntypedStorage`` and ``torch.TypedStorage``
that compute with data run with the capturing recorders suspended, as eager runs them.

    >>> import copy, torch, fxinit
    >>> class Holder(torch.nn.Module):
    ...     def __init__(self, t):
    ...         super().__init__()
    ...         self.register_buffer("b", copy.deepcopy(t))
    >>> fxinit.trace_init(Holder, torch.tensor([1.0, 2.0])).b.tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch

from fxinit.capture.patches import WhileCapturing

#: What reads only a storage's metadata, or is how storages are made and identified: no
#: tensor op inside, and capture's own code asks some of them often (``data_ptr``).
_METADATA = frozenset({
    "__new__", "__sizeof__", "_set_cdata", "_weak_ref", "_fix_weakref", "_expired", "_free_weak_ref",
    "_new_with_weak_ptr", "data_ptr", "_data_ptr", "nbytes", "_nbytes", "size", "_size", "element_size",
    "_element_size", "resizable", "is_shared", "_is_shared", "is_pinned", "get_device", "_get_filename",
    "_get_legacy_storage_class", "_pickle_storage_type", "pickle_storage_type", "_maybe_wrap_index",
    "_shared_incref", "_shared_decref", "_release_ipc_counter", "_release_ipc_counter_cuda", "_get_shared_fd",
})

_local = threading.local()  # .recorders: the recorders capturing in this thread


def _methods(cls: type) -> dict[str, Any]:
    """The instance methods of ``cls`` (and its bases) that may compute with data."""
    found: dict[str, Any] = {}
    for klass in cls.__mro__[:-1]:
        for name, attr in vars(klass).items():
            if name in found or name in _METADATA:
                continue
            if isinstance(attr, (staticmethod, classmethod)) or type(attr).__name__ == "classmethod_descriptor":
                continue  # (storages made from files or buffers: no tensor op)
            if callable(attr):
                found[name] = attr
    return found


#: Methods that write the storage's memory.
_WRITES = frozenset({"copy_", "fill_", "__setitem__", "_setitem", "resize_", "_resize_", "byteswap", "_byteswap",
                     "_set_from_file", "_swap_data_ptr_", "_resize_with_addr_"})


def _for_real(method: Callable[..., Any]) -> Callable[..., Any]:
    writes = method.__name__ in _WRITES

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        recorders = getattr(_local, "recorders", None)
        if not recorders:
            return method(self, *args, **kwargs)
        if writes:
            _refuse_writing_shared(self, method.__name__, recorders)
        with contextlib.ExitStack() as stack:
            for recorder in recorders:
                stack.enter_context(recorder.suspended())
            return method(self, *args, **kwargs)

    return run


def _refuse_writing_shared(storage: Any, name: str, recorders: list[Any]) -> None:
    """A write into memory a deferred tensor shares in eager construction (``w.data = t``, then
    ``t``'s storage written) would change both there; fxinit keeps the two apart (the deferred
    one took the value then), so it refuses, as it refuses the tensor ops that would."""
    for recorder in recorders:
        shared = recorder.lifted_reals.get(storage.data_ptr()) if recorder.lifted_reals else None
        if shared:
            raise recorder.fail(
                f"fxinit cannot run the storage's {name} here: this memory is shared with a deferred tensor in eager "
                f"construction ({shared}), so this write would change both there, and fxinit keeps them apart",
                op=f"UntypedStorage.{name}", hint="write before the `.data =` assignment, or write the tensor itself")


#: (class, name, its own attribute or None where inherited, the method run for real), made once
_PATCHES = [(cls, name, vars(cls).get(name), _for_real(method))
            for cls in (torch.UntypedStorage, torch.TypedStorage) for name, method in _methods(cls).items()]


def _install() -> None:
    for cls, name, _, for_real in _PATCHES:
        setattr(cls, name, for_real)


def _uninstall() -> None:
    for cls, name, own, _ in _PATCHES:
        if own is None:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


_patched = WhileCapturing(_install, _uninstall)


@contextlib.contextmanager
def real_storages(recorder: Any) -> Iterator[None]:
    """While ``recorder`` captures (in this thread), storage methods run with it suspended."""
    stack = _local.__dict__.setdefault("recorders", [])
    stack.append(recorder)
    try:
        with _patched():
            yield
    finally:
        stack.pop()
