"""Lazy modules (``nn.LazyLinear`` & co.) under capture.

Construction creates ``UninitializedParameter``s exactly as eager does (real, empty).
The shape-inferring dry run, run through :func:`fxinit.dry_run`, then materializes them
as *deferred* tensors, so their ``reset_parameters()`` is recorded like any other init
and draws from the generators where the eager dry run would.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.capture.swap import swap


@contextlib.contextmanager
def lazy_module_support(recorder: Any) -> Iterator[None]:
    originals = {
        UninitializedParameter: UninitializedParameter.__dict__["__new__"],
        UninitializedBuffer: UninitializedBuffer.__dict__["__new__"],
    }
    original_materialize = UninitializedTensorMixin.materialize

    def make_new(cls_: type, orig: Any) -> Any:
        fn = orig.__func__ if isinstance(orig, staticmethod) else orig

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            with recorder.suspended():
                return fn(cls, *args, **kwargs)

        return staticmethod(__new__)

    def materialize(self: torch.Tensor, shape: Any, device: Any = None, dtype: Any = None) -> None:
        with recorder.suspended():
            device = self.device if device is None else device
            dtype = self.dtype if dtype is None else dtype
            requires_grad = self.requires_grad
        value = FACTORIES.empty(shape, device=device, dtype=dtype)
        if isinstance(self, UninitializedParameter):
            new = torch.nn.Parameter(value, requires_grad=requires_grad)
        else:
            new = value.requires_grad_(requires_grad)
        new.__dict__.update(self.__dict__)  # (a buffer's ``persistent``, ``_is_buffer``: eager's object keeps them)
        swap(self, new)

    try:
        for cls, orig in originals.items():
            cls.__new__ = make_new(cls, orig)
        UninitializedTensorMixin.materialize = materialize
        yield
    finally:
        for cls, orig in originals.items():
            cls.__new__ = orig
        UninitializedTensorMixin.materialize = original_materialize
