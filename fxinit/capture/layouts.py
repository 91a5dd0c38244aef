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
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.capture.deferred import plain_attributes

aten = torch.ops.aten


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (meta) restrided batched column-major, as torch lays out LAPACK's results."""
    layout = FACTORIES.empty((*t.shape[:-2], t.shape[-1], t.shape[-2]), device="meta").mT
    return t.as_strided(t.shape, layout.stride())


def _svd_column_major(out: tuple) -> tuple:
    vh = out[2]
    return (out[0], out[1], _column_major(vh)) if vh.dim() >= 2 else out  # (no vectors: ``compute_uv=False``)


#: (op, what the CPU kernel's outputs look like from the meta kernel's)
_CPU = ((aten.linalg_eig.default, lambda out: (out[0], _column_major(out[1]))),
        (aten._linalg_svd.default, _svd_column_major))


def _fft_cpu(func: Any, out: torch.Tensor, args: tuple) -> torch.Tensor:
    """An FFT's output laid out as the CPU kernel lays it out: with MKL, dense in the order that
    kernel's ``_exec_fft`` permutes the dimensions into (aten/src/ATen/native/mkl/SpectralOps.cpp);
    with pocketfft (builds without MKL), contiguous."""
    x, dims = args[0], list(args[1])
    with plain_attributes():
        shape, strides = tuple(x.shape), tuple(x.stride())
    if not torch.backends.mkl.is_available():
        return out.as_strided(out.shape, _contiguous(out.shape))
    dims = [d % len(shape) for d in dims]
    if func is aten._fft_c2c.default:
        layout = _exec_fft(shape, strides, shape, _by_stride(dims, strides))
    elif func is aten._fft_r2c.default:
        layout = _exec_fft(shape, strides, tuple(out.shape), _by_stride(dims[:-1], strides) + dims[-1:])
    else:  # _fft_c2r: a c2c over all but the last dimension first, then a one-dimensional c2r
        if len(dims) > 1:
            strides = _exec_fft(shape, strides, shape, _by_stride(dims[:-1], strides))
        layout = _exec_fft(shape, strides, tuple(out.shape), dims[-1:])
    return out.as_strided(out.shape, layout)


def _by_stride(dims: list[int], strides: tuple[int, ...]) -> list[int]:
    """``dims`` by decreasing stride, ties kept in order (``std::sort`` of at most 16 elements
    is an insertion sort, which is stable)."""
    return sorted(dims, key=lambda d: -strides[d])


def _exec_fft(shape: tuple[int, ...], strides: tuple[int, ...], out_shape: tuple[int, ...],
              dims: list[int]) -> tuple[int, ...]:
    """The strides of ``_exec_fft``'s output: the batch dimensions (partitioned out as
    libstdc++'s ``std::partition`` does it, then by decreasing input stride) outermost, then the
    transformed ones in ``dims``' order, dense."""
    ndim = len(shape)
    transformed = set(dims)
    order = list(range(ndim))
    first, last = 0, ndim
    while True:  # std::partition over bidirectional iterators, keeping the batch dimensions first
        while first != last and order[first] not in transformed:
            first += 1
        if first == last:
            break
        last -= 1
        while first != last and order[last] in transformed:
            last -= 1
        if first == last:
            break
        order[first], order[last] = order[last], order[first]
        first += 1
    batch = sorted(order[:first], key=lambda d: -strides[d])
    signal = _contiguous((1, *(out_shape[d] for d in dims)))
    out = [0] * ndim
    numel = 1
    for d in reversed(batch):
        out[d] = numel * signal[0]
        numel *= out_shape[d]
    for i, d in enumerate(dims):
        out[d] = signal[1 + i]
    return tuple(out)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return FACTORIES.empty(shape, device="meta").stride()


_FFTS = (aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default)

#: batch norms whose CPU kernel returns no saved statistics (shape (0,)) unless it trains: op ->
#: the position of its ``training`` argument (None: never trains); the meta kernel gives them (C,)
_BATCH_NORMS = {aten.native_batch_norm.default: 5, aten._native_batch_norm_legit.default: 5,
                aten._native_batch_norm_legit_no_training.default: None}


def _batch_norm_cpu(func: Any, out: tuple, args: tuple) -> tuple:
    at = _BATCH_NORMS[func]
    if at is not None and (len(args) <= at or args[at]):
        return out
    return out[0], *(t.new_empty((0,)) for t in out[1:3]), *out[3:]


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
        if func in _FFTS and args and isinstance(out, torch.Tensor):
            return _fft_cpu(func, out, args)
        if func in _BATCH_NORMS:
            return _batch_norm_cpu(func, out, args)
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
