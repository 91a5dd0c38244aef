"""Output layouts where torch's meta kernel and the device's kernel disagree.

The capture learns an op's output strides from its meta kernel; eager gets the device
kernel's. Where they differ, code that depends on the layout takes another path while
recording (``.contiguous()`` copies or not, ``.view`` works or not), and materialize fails on a
view the real tensor does not allow. Found so far (torch 2.11-2.13, in a review of the
spectral ops): ``linalg_eig``'s eigenvectors, batched column-major on the CPU (LAPACK's
layout), row-major from the meta kernel. On CUDA they are row-major, as the meta kernel gives
them: ``linalg_eig_out`` (aten/src/ATen/native/BatchLinearAlgebra.cpp) computes a CUDA input's
on the CPU into a temporary and copies it into the output, which it resizes contiguous
(``vectors_tmp_needed |= vectors.is_cuda()``).
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (meta) restrided batched column-major, as torch lays out LAPACK's results."""
    layout = torch.empty((*t.shape[:-2], t.shape[-1], t.shape[-2]), device="meta").mT
    return t.as_strided(t.shape, layout.stride())


#: (op, what the CPU kernel's outputs look like from the meta kernel's)
_CPU = ((aten.linalg_eig.default, lambda out: (out[0], _column_major(out[1]))),)


def eager_layout(func: Any, out: Any, device: torch.device) -> Any:
    """The meta outputs ``out`` of ``func`` with the strides eager's kernel gives on ``device``
    (ops compared by identity: this runs for every recorded op, and an OpOverload hashes in Python)."""
    if device.type == "cpu":
        for op, fix in _CPU:
            if func is op:
                return fix(out)
    return out
