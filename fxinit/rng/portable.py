"""The portable random stream: values that are a function of (seed, key, element index) only.

Each random op of an init graph gets a *key* (the fully qualified name of the tensor it
writes and the op's ordinal among the random ops writing it, e.g.
``"model.layers.0.mlp.up_proj.weight/1"``). Element ``i`` of what the op writes draws the
64-bit word ``splitmix64(hash(seed, key) + (i + 1) * 0x9E3779B97F4A7C15)``, a counter-based
generator: no state, no order, no dependence on which other tensors are materialized, on
thread count, or on how a tensor is split into shards (a shard starting at element ``s``
computes the words ``s, s+1, ...``). Float32 and bfloat16 uniform and normal values are
made of integer work and single IEEE-754 operations (the normal's log and cos are fxinit's
own polynomials), so they are meant to be bitwise equal on every device; float64 normals and
the other distributions use torch's ``log1p``/``exp``/... whose last bit may differ between
devices. On CPU, fxinit's C kernel (``portable.c``) computes them when a compiler is
available, else torch ops do: the same bits.

Distributions follow the eager init functions: ``uniform_(a, b)``, ``normal_(mean, std)``
(Box-Muller from the two halves of one word), ``bernoulli_(p)``, ``exponential_``,
``random_``, ``cauchy_``, ``log_normal_``, ``geometric_``, ``randperm`` (argsort of words).
"""

from __future__ import annotations

import hashlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

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

    def uniform01(self, dtype: torch.dtype) -> torch.Tensor:
        return self.unit53() if dtype == torch.float64 else self.unit24(40)


_U64 = (1 << 64) - 1


def _sample_into(out: torch.Tensor, kind: str, w: "_Words", params: dict[str, float]) -> bool:
    """uniform/normal written straight into ``out`` (contiguous, ``w.n`` elements): by the C
    kernel for float32 and bfloat16 in one pass, else by torch ops for float32; False for
    anything else."""
    if kind not in _AFFINE or out.dtype not in _FUSED_DTYPES:
        return False
    scale, shift = _AFFINE[kind](params)
    if w.lib is not None:
        w.lib.fxinit_portable_fill(out.data_ptr(), _KINDS.index(kind), _FUSED_DTYPES.index(out.dtype), w.n, w.start,
                                   w.stream & _U64, float(scale), float(shift))
        return True
    if out.dtype != torch.float32:
        return False
    values = w.unit24(40, out) if kind == "uniform" else out.copy_(_normal24(w))
    values.mul_(scale).add_(shift)
    return True


_KINDS = ("uniform", "normal")  # the C kernel's kind codes
_FUSED_DTYPES = (torch.float32, torch.bfloat16)  # the C kernel's dtype codes
_AFFINE = {  # value = sample * scale + shift
    "uniform": lambda p: (p["high"] - p["low"], p["low"]),
    "normal": lambda p: (p["std"], p["mean"]),
}


def _standard_normal_(u1: torch.Tensor, u2: torch.Tensor) -> torch.Tensor:
    """Box-Muller in place for float64: ``u1`` becomes ``sqrt(-2 log(1 - u1)) cos(2 pi u2)``
    (``u2`` is overwritten). ``1 - u1`` is in (0, 1]: no log(0)."""
    u1.neg_().log1p_().mul_(-2.0).sqrt_()
    return u1.mul_(u2.mul_(2.0 * math.pi).cos_())


# portable.c's float constants, exactly (each is a float32 value)
_F = float.fromhex
_LN2, _TWO_PI_2_24 = _F("0x1.62e430p-1"), _F("0x1.921fb6p-22")
_LOG_SERIES = (_F("0x1.c71c72p-4"), _F("0x1.24924ap-3"), _F("0x1.99999ap-3"), _F("0x1.555556p-2"), 1.0)
_COS_SERIES = (_F("0x1.a01a02p-16"), -_F("0x1.6c16c2p-10"), _F("0x1.555556p-5"), -0.5, 1.0)
_SIN_SERIES = (_F("0x1.71de3ap-19"), -_F("0x1.a01a02p-13"), _F("0x1.111112p-7"), -_F("0x1.555556p-3"), 1.0)


def _horner(x2: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    p = x2 * coefficients[0] + coefficients[1]
    for c in coefficients[2:]:
        p = p.mul_(x2).add_(c)
    return p


def _normal24(w: "_Words") -> torch.Tensor:
    """Float32 standard normals with torch ops: portable.c's Box-Muller,
    ``sqrt(-2 log(1 - u1)) cos(2 pi u2)`` from the two 24-bit halves of each word."""
    neg2log = _neg2log24((1 << 24) - (_srl(w.w, 40) & 0xFFFFFF).to(torch.int32))  # 1 - u1 = m / 2^24
    # torch's float32 sqrt is not correctly rounded on every CPU; float64's, rounded to
    # float32, is (the square root of a float32 is never that close to a rounding boundary)
    return neg2log.double().sqrt_().float().mul_(_cos2pi24((_srl(w.w, 8) & 0xFFFFFF).to(torch.int32)))


# The log and cos of the portable normal are fxinit's own, made of single IEEE operations
# with the constants above, so that every device computes the same bits.
def _neg2log24(m: torch.Tensor) -> torch.Tensor:
    """``-2 log(m / 2^24)`` for int32 ``m`` in [1, 2^24], as portable.c's ``neg2log24``."""
    bits = m.to(torch.float32).view(torch.int32)  # m = 2^e f
    e = (bits >> 23) - 127
    fb = (bits & 0x7FFFFF) | 0x3F800000
    big = (fb > 0x3FB504F3).to(torch.int32)  # f > sqrt(2): halve it
    fb, e = fb - (big << 23), e + big
    f = fb.view(torch.float32)
    s = (f - 1.0) / (f + 1.0)  # log f = 2 atanh(s)
    log_f = (s + s).mul_(_horner(s * s, _LOG_SERIES))
    return (e - 24).to(torch.float32).mul_(_LN2).add_(log_f).mul_(-2.0)


def _cos2pi24(j: torch.Tensor) -> torch.Tensor:
    """``cos(2 pi j / 2^24)`` for int32 ``j`` in [0, 2^24), as portable.c's ``cos2pi24``."""
    t = (j + (1 << 21)) & 0xFFFFFF  # an eighth of a turn on
    q = t >> 22  # quadrant
    x = ((t & 0x3FFFFF) - (1 << 21)).to(torch.float32).mul_(_TWO_PI_2_24)  # angle in [-pi/4, pi/4)
    x2 = x * x
    cos, sin = _horner(x2, _COS_SERIES), _horner(x2, _SIN_SERIES).mul_(x)
    v = torch.where((q & 1) == 1, sin, cos)
    return torch.where(((q + 1) & 2) != 0, -v, v)


def sample(kind: str, stream: int, start: int, n: int, dtype: torch.dtype, device: torch.device | str,
           out: torch.Tensor | None = None, **params: float) -> torch.Tensor:
    """``n`` values of distribution ``kind`` for elements ``start ..``, computed in float32
    (float64 for float64 targets) and returned in ``dtype`` (written into ``out`` where a
    fused sampler can, see ``_sample_into``)."""
    w = _Words(stream, start, n, device)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if out is not None and out.is_contiguous() and out.numel() == n and _sample_into(out, kind, w, params):
        return out
    if kind == "uniform":
        out = w.uniform01(dtype).mul_(params["high"] - params["low"]).add_(params["low"])
    elif kind == "normal":
        if work == torch.float64:
            z = _standard_normal_(w.unit53(), _Words(stream ^ 0x5DEECE66D, start, n, device).unit53())
        else:
            z = _normal24(w)
        out = z.mul_(params["std"]).add_(params["mean"])
    elif kind == "bernoulli":
        out = (w.uniform01(dtype) < params["p"]).to(work)
    elif kind == "exponential":
        out = -torch.log1p(-w.uniform01(dtype)) / params["lambd"]
    elif kind == "cauchy":
        out = params["median"] + params["sigma"] * torch.tan(math.pi * (w.uniform01(dtype) - 0.5))
    elif kind == "log_normal":
        out = torch.exp(_normal24(w).to(work).mul_(params["std"]).add_(params["mean"]))
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
        if flat is not None:
            piece = flat[start:start + size]
            values = sample(kind, stream, first + start, size, target.dtype, target.device, out=piece, **params)
            if values is not piece:  # no fused sampler for this kind and dtype
                piece.copy_(values)
        else:
            _strided_chunk(target, start, size).copy_(
                sample(kind, stream, first + start, size, target.dtype, target.device, **params))

    starts = range(0, n, CHUNK)
    serial = flat is None or getattr(_THREAD, "serial", False)
    workers = 1 if serial else min(torch.get_num_threads(), len(starts))
    if workers <= 1:
        for s in starts:
            run(s)
    else:  # chunks are independent: the split and the thread count cannot change a value
        with ThreadPoolExecutor(workers, "fxinit-portable") as pool:
            list(pool.map(run, starts))
    return target


_THREAD = threading.local()


@contextmanager
def serial_fills() -> Iterator[None]:
    """Fills in this thread run on it alone: for threads that already run beside others on
    every core, where more threads per fill would only compete with them."""
    before = getattr(_THREAD, "serial", False)
    _THREAD.serial = True
    try:
        yield
    finally:
        _THREAD.serial = before


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
