"""Output layouts where torch's meta kernel and the device's kernel disagree.

The capture learns an op's output strides from its meta kernel; eager gets the device
kernel's. Where they differ, code that depends on the layout takes another path while
recording (``.contiguous()`` copies or not, ``.view`` works or not), and materialize fails on a
view the real tensor does not allow. Found so far (torch 2.11-2.13, in a review of the
spectral ops): ``linalg_eig``'s eigenvectors, batched column-major on the CPU (LAPACK's
layout), row-major from the meta kernel. On CUDA they are row-major, as the meta kernel gives
them: ``linalg_eig_out`` (aten/src/ATen/native/BatchLinearAlgebra.cpp) computes a CUDA input's
on the CPU into a temporary and copies it into the output, which it resizes contiguous
(``vectors_tmp_needed |= vectors.is_cuda()``). And ``_linalg_svd``'s ``Vh`` (``torch.linalg.svd``,
``torch.svd``'s ``V``, ``svd_lowrank``, peft's OSF and PiSSA), column-major on the CPU, row-major
from the meta kernel, as on CUDA where cuSOLVER computes it (``_linalg_svd``'s structured meta
function, BatchLinearAlgebra.cpp: ``f_contig = !use_cusolver``); with MAGMA preferred, CUDA's is
column-major too. A wrong ``Vh`` layout gave wrong values, not only strides: ``Vh[k:].contiguous()``
recorded no copy, two such buffers shared a storage, and a ``randn_like`` of one drew another path
(found by a sweep of peft).
"""

from __future__ import annotations

from typing import Any

import torch

from fxinit.capture.deferred import plain_attributes

aten = torch.ops.aten


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (meta) restrided batched column-major, as torch lays out LAPACK's results."""
    layout = torch.empty((*t.shape[:-2], t.shape[-1], t.shape[-2]), device="meta").mT
    return t.as_strided(t.shape, layout.stride())


def _svd_column_major(out: tuple) -> tuple:
    vh = out[2]
    return (out[0], out[1], _column_major(vh)) if vh.dim() >= 2 else out  # (no vectors: ``compute_uv=False``)


#: (op, what the CPU kernel's outputs look like from the meta kernel's)
_CPU = ((aten.linalg_eig.default, lambda out: (out[0], _column_major(out[1]))),
        (aten._linalg_svd.default, _svd_column_major))


def _magma_preferred() -> bool:
    return torch.backends.cuda.preferred_linalg_library() == torch._C._LinalgBackend.Magma

#: The ``*_like`` factories. With ``preserve_format``, eager's ``empty_like`` (one kernel for every
#: device) takes the strides of an input without overlap or gaps as they are; the meta kernel
#: recomputes them, and differs at dimensions of size one (``zeros_like`` of ``w.t()``, ``w`` of
#: shape (1, 2): strides (1, 2) in eager, (1, 1) from meta; found by tools/fuzz_capture.py).
_LIKE = frozenset(id(getattr(getattr(aten, name), overload)) for name in (  # by id: see eager_layout
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like")
    for overload in getattr(aten, name).overloads())


def eager_layout(func: Any, out: Any, device: torch.device, args: tuple = (), kwargs: dict | None = None) -> Any:
    """The meta outputs ``out`` of ``func(*args, **kwargs)`` with the strides eager's kernel
    gives on ``device`` (ops compared by identity: this runs for every recorded op, and an
    OpOverload hashes in Python)."""
    if device.type == "cpu":
        for op, fix in _CPU:
            if func is op:
                return fix(out)
    elif func is aten._linalg_svd.default and device.type == "cuda" and _magma_preferred():
        return _svd_column_major(out)
    if id(func) in _LIKE and device.type != "meta" and args and isinstance(out, torch.Tensor):
        return _like_strides(out, args[0], (kwargs or {}).get("memory_format"))
    return out


def _like_strides(out: torch.Tensor, x: Any, memory_format: Any) -> torch.Tensor:
    with plain_attributes():
        if memory_format not in (None, torch.preserve_format) or not isinstance(x, torch.Tensor) \
                or x.shape != out.shape or x.stride() == out.stride() or not out.numel() \
                or not _dense(x.shape, x.stride()):
            return out
        return out.as_strided(out.shape, x.stride(), 0)


def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Without overlap or gaps: some order of the dimensions is contiguous (torch's
    ``is_non_overlapping_and_dense``; dimensions of size one can have any stride)."""
    expected = 1
    for st, size in sorted((st, size) for size, st in zip(shape, stride) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True
