"""What a value of an init graph is, without its data: shape and placement, and what an
output is besides its value. Everything after capture describes tensors with these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class TensorSpec(NamedTuple):
    """Shape and placement of a value, as eager construction would have it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @staticmethod
    def of(t: torch.Tensor, device: torch.device) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, device)

    def is_contiguous(self) -> bool:
        """Whether a tensor of this shape and these strides is contiguous (torch's rule)."""
        if 0 in self.shape:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1:
                if stride != expected:
                    return False
                expected *= size
        return True


@dataclass(frozen=True)
class OutputInfo:
    """What a named output is besides its value."""

    requires_grad: bool
    is_parameter: bool
    persistent: bool = True


def cast_by_to(dtype: torch.dtype) -> bool:
    """Whether ``Module.to(another dtype)`` casts tensors of ``dtype``."""
    return dtype.is_floating_point or dtype.is_complex


def dtype_after_to(current: torch.dtype, requested: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``current`` has after ``Module.to(requested)``: floating-point
    and complex tensors take ``requested``, the others keep theirs."""
    return requested if requested is not None and cast_by_to(current) else current


def copy_with_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides, in memory of its own. Where elements share memory
    (``expand``'s stride 0) they share it in the copy too: the span of memory ``t`` reads is
    copied, as torch writes no tensor whose elements overlap."""
    t = t.detach()
    if torch._debug_has_internal_overlap(t) == 0:  # no overlap, surely
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    span = 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride())) if t.numel() else 0
    return t.as_strided((span,), (1,)).clone().as_strided(t.size(), t.stride())
