"""The portable stream's uniform and normal fills as a hand-written Triton kernel.

The kernel computes what ``portable.c`` computes, operation for operation: each program
takes ``BLOCK`` Box-Muller pairs (one splitmix64 word each), makes the pair's two samples
with fxinit's own log, cos and sin polynomials (single IEEE-754 operations on float32, no
division, a correctly rounded square root: ``sqrt_rn``), applies ``* scale + shift`` and
rounds to the fill's dtype, then to the output's dtype (a fused cast), both to nearest even.
It is launched with ``enable_fp_fusion=False``, so no ``a * b + c`` is contracted into a
fused multiply-add: the bits are the C kernel's and the torch-op twin's.

Why a kernel of its own rather than Inductor's: it is one launch with no guards to check,
compiles in about a second once per (kind, dtype, cast) and is cached by Triton across
processes, and calling it never enters Dynamo (whose compilation from one thread breaks its
calls from others).

On a machine without a GPU the same kernel runs under Triton's interpreter (numpy) on CPU
tensors: that is how CI checks its bits against the C kernel (``tests/test_portable_triton.py``).

>>> import torch
>>> from fxinit.rng import portable_triton
>>> out = torch.empty(10)
>>> portable_triton.fill(out, "normal", start=0, stream=42, scale=1.0, shift=0.0, interpret=True)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
from typing import Any

import torch

from fxinit.rng.portable import Piece, fill_table, on_device, signed64, table_pairs

#: Box-Muller pairs per program (two output elements each).
BLOCK = 1024
#: Triton's compile options of every launch: no ``a * b + c`` contracted into a fused multiply-add.
OPTIONS = {"enable_fp_fusion": False}
KINDS = ("uniform", "normal")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> str | None:
    """Why fxinit's Triton kernel cannot run here, or None if it can (Triton importable)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool) -> Any:
    """The jitted kernel (Triton's interpreter when ``interpret``), defined on first use so
    that importing fxinit never imports Triton."""
    import triton

    from fxinit.rng.portable_triton_kernel import fill

    options = dict(do_not_specialize=["n", "start", "stream", "scale", "shift"])
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fill, **options)
    return triton.jit(fill, **options)


_TL_DTYPES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                                      torch.float16: "float16"}
_LOCK = threading.Lock()


def fill(out: torch.Tensor, kind: str, start: int, stream: int, scale: float, shift: float,
         dtype: torch.dtype | None = None, interpret: bool = False) -> None:
    """Elements ``start .. start + out.numel()`` of a portable ``kind`` fill (``uniform`` or
    ``normal``), each ``sample * scale + shift`` in float32 rounded to ``dtype`` (default:
    ``out``'s), written into contiguous ``out`` (of ``out``'s dtype: a fused cast when they
    differ). ``interpret``: Triton's interpreter (CPU tensors), for checking bits."""
    n = out.numel()
    if n == 0:
        return
    pairs = ((start + n - 1) >> 1) - (start >> 1) + 1
    _launch(out, None, ((pairs + BLOCK - 1) // BLOCK,), n, start, kind, stream, scale, shift, dtype, interpret)


#: Elements of one row of a launch's table at most (longer runs are cut): a row's blocks go on
#: the grid's second axis, as many as the longest row needs, so rows of one length keep the
#: blocks of shorter ones that find nothing to do few.
ROW = 2 * BLOCK * 256


def fill_runs(out: torch.Tensor, kind: str, runs: Any, stream: int, scale: float, shift: float,
              dtype: torch.dtype | None = None, interpret: bool = False) -> None:
    """For each row ``(lo, hi, at)`` of ``runs`` (an int64 array): elements ``lo .. hi`` of the
    fill into ``out[at ..]`` (``out`` flat and contiguous), in one launch: a rank's shard
    drawn straight from the streams of the tensors it is cut from (``plan.forwards``)."""
    fill_many(kind, [(out, runs, stream, scale, shift)], dtype, interpret)


def fill_many(kind: str, pieces: list[Piece], dtype: torch.dtype | None = None, interpret: bool = False) -> None:
    """Every ``(out, runs, stream, scale, shift)`` of ``pieces`` as ``fill_runs`` fills it, in
    one launch: a model's fills of one kind and dtype (``passes.batched_fills``) without a
    launch each. The ``out`` tensors share a dtype and a device."""
    table = fill_table(pieces, ROW)
    if len(table) == 0:
        return
    longest = table_pairs(table)
    out = pieces[0][0]
    _launch(out, on_device(table, out.device), (len(table), (longest + BLOCK - 1) // BLOCK), 0, 0, kind, 0, 0.0,
            0.0, dtype, interpret)


def _launch(out: torch.Tensor, table: torch.Tensor | None, grid: tuple[int, ...], n: int, start: int, kind: str,
            stream: int, scale: float, shift: float, dtype: torch.dtype | None, interpret: bool) -> None:
    import triton.language as tl

    if not out.is_contiguous() or out.dtype not in DTYPES or (dtype or out.dtype) not in DTYPES:
        raise ValueError(f"the Triton fill writes contiguous {', '.join(map(str, DTYPES))} tensors, not {out.dtype}")
    kernel = _kernel(interpret)
    # the interpreter patches triton.language while it runs; Triton launches on the thread's
    # current CUDA device, which is device 0 on a new thread whatever the tensor's device
    with _LOCK if interpret else device_of(out):
        kernel[grid](out, out if table is None else table, n, start, signed64(stream), float(scale), float(shift),
                     KIND=KINDS.index(kind), DTYPE=getattr(tl, _TL_DTYPES[dtype or out.dtype]),
                     OUT=getattr(tl, _TL_DTYPES[out.dtype]), BLOCK=BLOCK, TABLE=table is not None, **OPTIONS)


def device_of(t: torch.Tensor) -> Any:
    """A context making ``t``'s CUDA device the current one (nothing for other devices)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
