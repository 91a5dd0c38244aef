"""The portable random stream: values that are a function of (seed, key, element index) only.

Each random op of an init graph gets a *key* (the fully qualified name of the tensor it
writes and the op's ordinal among the random ops writing it, e.g.
``"model.layers.0.mlp.up_proj.weight/1"``). Element ``i`` of what the op writes draws the
64-bit word ``splitmix64(hash(seed, key) + (i + 1) * 0x9E3779B97F4A7C15)``, a counter-based
generator: no state, no order, no dependence on which other tensors are materialized, on
thread count, or on how a tensor is split into shards (a shard starting at element ``s``
computes the words ``s, s+1, ...``). Integer arithmetic is exact on every device, so uniform
values are bitwise equal across devices; normal values go through ``log1p``/``cos``, whose
last bit may differ between devices. On CPU the words come from fxinit's C kernel
(``portable.c``) when a compiler is available, else from torch ops: the same bits.

Distributions follow the eager init functions: ``uniform_(a, b)``, ``normal_(mean, std)``
(Box-Muller from the two halves of one word), ``bernoulli_(p)``, ``exponential_``,
``random_``, ``cauchy_``, ``log_normal_``, ``geometric_``, ``randperm`` (argsort of words).
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from fxinit.rng.native import portable_library

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
CHUNK = 1 << 20


def stream_key(seed: int, key: str) -> int:
    """The 64-bit (signed) stream constant of ``key`` under ``seed``."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words seen as unsigned."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def words(stream: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` 64-bit words (int64) of ``stream`` for elements ``start .. start+n-1``."""
    z = (torch.arange(start + 1, start + n + 1, dtype=torch.int64, device=device) * GOLDEN) + stream
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


class _Words:
    """The words of elements ``start .. start+n`` of a stream, and unit floats made from them:
    by fxinit's C kernel on CPU when it is available, else by torch ops (same bits)."""

    def __init__(self, stream: int, start: int, n: int, device: torch.device | str) -> None:
        self.stream, self.start, self.n, self.device = stream, start, n, torch.device(device)
        self.lib = portable_library() if self.device.type == "cpu" else None
        self._w: torch.Tensor | None = None

    @property
    def w(self) -> torch.Tensor:
        if self._w is None:
            self._w = words(self.stream, self.start, self.n, self.device)
        return self._w

    def unit24(self, shift: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """A float32 in [0, 1) from 24 bits of each word, from bit ``shift`` up (into ``out``
        if given)."""
        if self.lib is not None:
            out = torch.empty(self.n, dtype=torch.float32) if out is None else out
            self.lib.fxinit_portable_unit24(out.data_ptr(), self.n, self.start, self.stream & _U64, shift)
            return out
        values = (_srl(self.w, shift) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))
        return values if out is None else out.copy_(values)

    def unit53(self) -> torch.Tensor:
        if self.lib is not None:
            out = torch.empty(self.n, dtype=torch.float64)
            self.lib.fxinit_portable_unit53(out.data_ptr(), self.n, self.start, self.stream & _U64)
            return out
        return _srl(self.w, 11).to(torch.float64) * (1.0 / (1 << 53))

    def unit24_pair(self, hi: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(unit24(40), unit24(8))``, the first written into ``hi`` if given."""
        if self.lib is not None:
            hi = torch.empty(self.n, dtype=torch.float32) if hi is None else hi
            lo = torch.empty(self.n, dtype=torch.float32)
            self.lib.fxinit_portable_unit24x2(hi.data_ptr(), lo.data_ptr(), self.n, self.start, self.stream & _U64)
            return hi, lo
        return self.unit24(40, hi), self.unit24(8)

    def uniform01(self, dtype: torch.dtype) -> torch.Tensor:
        return self.unit53() if dtype == torch.float64 else self.unit24(40)


_U64 = (1 << 64) - 1


def _sample_into(out: torch.Tensor, kind: str, w: "_Words", params: dict[str, float]) -> bool:
    """uniform/normal computed in place in ``out`` (contiguous float32): the same float
    operations, in the same order, as ``sample``, without its temporaries."""
    if kind == "uniform":
        w.unit24(40, out).mul_(params["high"] - params["low"]).add_(params["low"])
        return True
    if kind == "normal":
        _standard_normal_(*w.unit24_pair(out)).mul_(params["std"]).add_(params["mean"])
        return True
    return False


def _standard_normal_(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """Box-Muller in place: ``u1`` becomes ``sqrt(-2 log(1 - u1)) cos(2 pi u2)`` (``u2`` is
    overwritten). ``1 - u1`` is in (0, 1]: no log(0)."""
    u1.neg_().log1p_().mul_(-2.0).sqrt_()
    return u1.mul_(u2.mul_(2.0 * math.pi).cos_())


def sample(kind: str, stream: int, start: int, n: int, dtype: torch.dtype, device: torch.device | str,
           out: torch.Tensor | None = None, **params: float) -> torch.Tensor:
    """``n`` values of distribution ``kind`` for elements ``start ..``, computed in float32
    (float64 for float64 targets) and returned in ``dtype`` (in ``out`` if it is given and
    a contiguous float32 tensor of ``n`` elements)."""
    w = _Words(stream, start, n, device)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if out is not None and out.dtype == torch.float32 and out.is_contiguous() and _sample_into(out, kind, w, params):
        return out
    if kind == "uniform":
        out = w.uniform01(dtype).mul_(params["high"] - params["low"]).add_(params["low"])
    elif kind == "normal":
        if work == torch.float64:
            u1 = w.unit53()
            u2 = _Words(stream ^ 0x5DEECE66D, start, n, device).unit53()
        else:
            u1, u2 = w.unit24(40), w.unit24(8)
        out = _standard_normal_(u1, u2).mul_(params["std"]).add_(params["mean"])
    elif kind == "bernoulli":
        out = (w.uniform01(dtype) < params["p"]).to(work)
    elif kind == "exponential":
        out = -torch.log1p(-w.uniform01(dtype)) / params["lambd"]
    elif kind == "cauchy":
        out = params["median"] + params["sigma"] * torch.tan(math.pi * (w.uniform01(dtype) - 0.5))
    elif kind == "log_normal":
        z = _standard_normal_(w.unit24(40).to(work), w.unit24(8).to(work))
        out = torch.exp(z.mul_(params["std"]).add_(params["mean"]))
    elif kind == "geometric":
        u = w.uniform01(dtype).to(torch.float64)
        out = torch.ceil(torch.log1p(-u) / math.log1p(-params["p"])).clamp_min(1)
    elif kind == "random":
        low, high = int(params["low"]), int(params["high"])
        span = high - low
        out = low + (_srl(w.w, 1) % span)  # span << 2^63: the modulo bias is negligible
        return out.to(dtype)
    else:
        raise ValueError(f"no portable sampler for {kind!r}")
    return out.to(dtype)


def fill_(target: torch.Tensor, kind: str, stream: int, first: int = 0, **params: float) -> torch.Tensor:
    """Fill ``target`` (any layout) element by element in logical order, chunk by chunk;
    its element ``k`` gets the stream's element ``first + k`` (a piece of a larger tensor)."""
    n = target.numel()
    flat = target.view(-1) if target.is_contiguous() else None

    def run(start: int) -> None:
        size = min(CHUNK, n - start)
        if flat is not None and flat.dtype == torch.float32:
            piece = flat[start:start + size]
            values = sample(kind, stream, first + start, size, target.dtype, target.device, out=piece, **params)
            if values is not piece:  # kinds without an in-place sampler
                piece.copy_(values)
            return
        values = sample(kind, stream, first + start, size, target.dtype, target.device, **params)
        if flat is not None:
            flat[start:start + size].copy_(values)
        else:
            _strided_chunk(target, start, size).copy_(values)

    starts = range(0, n, CHUNK)
    workers = min(torch.get_num_threads(), len(starts)) if flat is not None else 1
    if workers <= 1:
        for s in starts:
            run(s)
    else:  # chunks are independent: the split and the thread count cannot change a value
        with ThreadPoolExecutor(workers, "fxinit-portable") as pool:
            list(pool.map(run, starts))
    return target


def _strided_chunk(target: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """A writable view of logical elements ``start .. start+size`` of a non-contiguous tensor
    (via an index map; used only for the rare strided random write)."""
    idx = torch.arange(start, start + size, device=target.device)
    coords = []
    for dim in reversed(target.shape):
        coords.append(idx % dim)
        idx = idx // dim
    offsets = sum(c * s for c, s in zip(reversed(coords), target.stride()))
    base = torch.as_strided(target, (target.untyped_storage().nbytes() // target.element_size(),), (1,), 0)
    return _IndexedView(base, offsets + target.storage_offset())


class _IndexedView:
    """``copy_`` into scattered storage positions."""

    def __init__(self, base: torch.Tensor, offsets: torch.Tensor) -> None:
        self.base, self.offsets = base, offsets

    def copy_(self, values: torch.Tensor) -> None:
        self.base.index_copy_(0, self.offsets, values.to(self.base.dtype))


def randperm(stream: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A permutation of ``range(n)``: the argsort of the stream's words (ties cannot matter:
    a stable sort orders equal words by index)."""
    return torch.argsort(words(stream, 0, n, device), stable=True)
