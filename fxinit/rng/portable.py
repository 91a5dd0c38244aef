"""The portable random stream: values that are a function of (seed, key, element index) only.

Each random op of an init graph gets a *key* (the fully qualified name of the tensor it
writes and the op's ordinal among the random ops writing it, e.g.
``"model.layers.0.mlp.up_proj.weight/1"``). Word ``k`` of the op's stream is the 64-bit
``splitmix64(hash(seed, key) + (k + 1) * 0x9E3779B97F4A7C15)``, a counter-based generator:
no state, no order, no dependence on which other tensors are materialized, on thread count,
or on how a tensor is split into shards (a shard starting at element ``s`` computes the words
from ``s // 2`` on).

Float32 and bfloat16 samples take 24 bits per element, two elements per word: element ``i``
takes bits 8..31 of word ``i // 2`` when ``i`` is even, bits 40..63 when it is odd (its *unit*
``u_i``, read as ``u_i / 2^24`` in [0, 1)). ``uniform_(a, b)`` writes ``u_i (b - a) + a``;
``normal_(mean, std)`` writes Box-Muller pairs: elements ``2k`` and ``2k+1`` are ``r cos t``
and ``r sin t`` with ``r = sqrt(-2 log(1 - u_2k+1))`` and ``t = 2 pi u_2k``, times ``std`` plus
``mean``. They are computed in float32 with single IEEE-754 operations (+, -, *, sqrt; the log,
cos and sin are fxinit's own polynomials, no division), then rounded to the target dtype, so
they are meant to be bitwise equal on every device. Float64 samples take one word per element
(its top 53 bits; a float64 normal pairs it with the word of a second stream), and use torch's
``log1p``/``cos``, as the other distributions do, whose last bit may differ between devices.

On CPU, fxinit's C kernel (``portable.c``) computes float32/bfloat16 uniform and normal fills
when a compiler is available; elsewhere the torch-op twin below does (``units24``,
``normal24``, ``sample24``: element-wise functions of element indices): the same bits. The twin is element-wise torch ops without data-dependent control
flow, so that a compiler (Inductor) can fuse it; it must then keep every operation rounded on
its own: no contraction of ``a * b + c`` into a fused multiply-add (Triton's
``enable_fp_fusion=False``) and a correctly rounded ``sqrt`` (the twin takes it in float64,
since torch's float32 ``sqrt`` on CPU is not correctly rounded).

Distributions follow the eager init functions: ``uniform_(a, b)``, ``normal_(mean, std)``,
``bernoulli_(p)``, ``exponential_``, ``random_``, ``cauchy_``, ``log_normal_``,
``geometric_``, ``randperm`` (argsort of words).
"""

from __future__ import annotations

import hashlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from fxinit.rng.native import portable_library

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
CHUNK = 1 << 20
#: Which values the stream gives; a change of any sampler's values changes it (an export
#: started with other values is not resumed: ``export.resume``). 2: ``trunc_normal_`` by rejection.
STREAM_VERSION = 2
#: Elements per chunk of the torch-op twin on other devices (a GPU), one chunk at a time: each
#: of its ~40 ops is a launch, which must be worth it; its temporaries take ~250 MB.
DEVICE_CHUNK = 1 << 23


def stream_key(seed: int, key: str) -> int:
    """The 64-bit (signed) stream constant of ``key`` under ``seed``."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 words seen as unsigned."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer of int64 counters."""
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def words(stream: int, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` 64-bit words (int64) of ``stream``: words ``start .. start+n-1``."""
    return _mix(torch.arange(start + 1, start + n + 1, dtype=torch.int64, device=device) * GOLDEN + stream)


# The torch-op twin: element-wise functions of element indices ``i`` (int64) and a stream
# constant (an int, or an int64 tensor: a runtime argument of a compiled kernel).
Stream = int | torch.Tensor


def _word_pairs(i: torch.Tensor, stream: Stream) -> tuple[torch.Tensor, torch.Tensor]:
    """For elements ``i``: the word of each one's pair (int64) and whether it is the pair's
    odd element (0 or 1, int64)."""
    return _mix(((i >> 1) + 1) * GOLDEN + stream), i & 1


def units24(i: torch.Tensor, stream: Stream) -> torch.Tensor:
    """The 24-bit units (int32) of elements ``i``: bits 8..31 of the pair's word for an even
    element, bits 40..63 for an odd one."""
    w, odd = _word_pairs(i, stream)
    return ((w >> (8 + 32 * odd)) & 0xFFFFFF).to(torch.int32)


def range24(kind: str, stream: int, start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """Float32 standard samples (``uniform`` in [0, 1), or ``normal``) of elements ``start ..
    start+n``, by torch ops: ``sample24``'s bits, computed once per Box-Muller pair (one word,
    one radius, one cos and sin) rather than once per element."""
    w = words(stream, start >> 1, ((start + n - 1) >> 1) - (start >> 1) + 1, device)
    even, odd = ((w >> 8) & 0xFFFFFF).to(torch.int32), ((w >> 40) & 0xFFFFFF).to(torch.int32)
    del w
    if kind == "uniform":
        a, b = even.to(torch.float32).mul_(1.0 / (1 << 24)), odd.to(torch.float32).mul_(1.0 / (1 << 24))
    else:
        radius = _neg2log24((1 << 24) - odd).double().sqrt_().float()  # as in ``normal24``
        a, b = _cos_sin2pi24(even)
        a.mul_(radius)
        b.mul_(radius)
    first = start & 1
    return torch.stack((a, b), dim=1).view(-1)[first:first + n]


def sample24(kind: str, i: torch.Tensor, stream: Stream) -> torch.Tensor:
    """Float32 standard samples of elements ``i``: ``uniform`` in [0, 1), or ``normal``."""
    if kind == "uniform":
        return units24(i, stream).to(torch.float32) * (1.0 / (1 << 24))
    return normal24(i, stream)


class _Words:
    """The words of elements ``start .. start+n`` of a stream, and unit floats made from them:
    by fxinit's C kernel on CPU when it is available, else by torch ops (same bits)."""

    def __init__(self, stream: int, start: int, n: int, device: torch.device | str) -> None:
        self.stream, self.start, self.n, self.device = stream, start, n, torch.device(device)
        self.lib = portable_library() if self.device.type == "cpu" else None
        self._w: torch.Tensor | None = None

    @property
    def w(self) -> torch.Tensor:
        """One word per element (float64 units, ``random_``)."""
        if self._w is None:
            self._w = words(self.stream, self.start, self.n, self.device)
        return self._w

    def unit24(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each element's unit as a float32 in [0, 1) (into ``out`` if given)."""
        if self.lib is not None:
            out = torch.empty(self.n, dtype=torch.float32) if out is None else out
            self.lib.fxinit_portable_fill(out.data_ptr(), _KINDS.index("uniform"), 0, self.n, self.start,
                                          self.stream & _U64, 1.0, 0.0)  # u * 1 + 0 is u
            return out
        values = range24("uniform", self.stream, self.start, self.n, self.device)
        return values if out is None else out.copy_(values)

    def unit53(self) -> torch.Tensor:
        if self.lib is not None:
            out = torch.empty(self.n, dtype=torch.float64)
            self.lib.fxinit_portable_unit53(out.data_ptr(), self.n, self.start, self.stream & _U64)
            return out
        return _srl(self.w, 11).to(torch.float64) * (1.0 / (1 << 53))

    def uniform01(self, dtype: torch.dtype) -> torch.Tensor:
        return self.unit53() if dtype == torch.float64 else self.unit24()

    def normal24(self) -> torch.Tensor:
        """Float32 standard normals by the torch-op twin (on any device)."""
        return range24("normal", self.stream, self.start, self.n, self.device)


_U64 = (1 << 64) - 1


def _sample_into(out: torch.Tensor, kind: str, w: "_Words", params: dict[str, float]) -> bool:
    """uniform/normal written straight into ``out`` (contiguous, ``w.n`` elements): by the C
    kernel for float32 and bfloat16 in one pass, else by torch ops for float32; False for
    anything else."""
    if kind not in _AFFINE or out.dtype not in _FUSED_DTYPES:
        return False
    scale, shift = affine(kind, params)
    if w.lib is not None:
        w.lib.fxinit_portable_fill(out.data_ptr(), _KINDS.index(kind), _FUSED_DTYPES.index(out.dtype), w.n, w.start,
                                   w.stream & _U64, float(scale), float(shift))
        return True
    if out.dtype != torch.float32:
        return False
    values = w.unit24(out) if kind == "uniform" else out.copy_(w.normal24())
    values.mul_(scale).add_(shift)
    return True


_KINDS = ("uniform", "normal")  # the C kernel's kind codes
_FUSED_DTYPES = (torch.float32, torch.bfloat16)  # the C kernel's dtype codes
def affine(kind: str, params: dict[str, float]) -> tuple[float, float]:
    """``(scale, shift)`` of a uniform or normal fill: its values are ``sample24 * scale + shift``."""
    return _AFFINE[kind](params)


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
_LN2_HI, _LN2_LO, _TWO_PI_2_24 = _F("0x1.63p-1"), -_F("0x1.bd0106p-13"), _F("0x1.921fb6p-22")
_LOG_P = tuple(map(_F, ("0x1.204376p-4", "-0x1.d7a370p-4", "0x1.de4a34p-4", "-0x1.fcba9ep-4", "0x1.23d37ep-3",
                        "-0x1.555ca0p-3", "0x1.999d58p-3", "-0x1.fffff8p-3", "0x1.555554p-2")))
_COS = tuple(map(_F, ("0x1.a01a02p-16", "-0x1.6c16c2p-10", "0x1.555556p-5", "-0x1p-1")))  # 1/8!, -1/6!, 1/4!, -1/2
_SIN = tuple(map(_F, ("0x1.71de3ap-19", "-0x1.a01a02p-13", "0x1.111112p-7", "-0x1.555556p-3")))  # 1/9! .. -1/3!


def _estrin4(z: torch.Tensor, z2: torch.Tensor, c: tuple[float, ...]) -> torch.Tensor:
    """``(c0 z + c1) z^2 + (c2 z + c3)``, as portable.c groups it."""
    return (z * c[0] + c[1]).mul_(z2).add_(z * c[2] + c[3])


def normal24(i: torch.Tensor, stream: Stream) -> torch.Tensor:
    """Float32 standard normals of elements ``i`` with torch ops, element by element:
    portable.c's Box-Muller."""
    word, odd = _word_pairs(i, stream)
    odd_unit, even_unit = (((word >> shift) & 0xFFFFFF).to(torch.int32) for shift in (40, 8))
    # torch's float32 sqrt is not correctly rounded on every CPU; float64's, rounded to
    # float32, is (the square root of a float32 is never that close to a rounding boundary)
    radius = _neg2log24((1 << 24) - odd_unit).double().sqrt_().float()
    return radius.mul_(_cos2pi24(even_unit, odd.to(torch.int32)))  # r cos t, or r sin t for odd elements


# The log, cos and sin of the portable normal are fxinit's own, made of single IEEE operations
# with the constants above, so that every device computes the same bits.
def _neg2log24(m: torch.Tensor) -> torch.Tensor:
    """``-2 log(m / 2^24)`` for int32 ``m`` in [1, 2^24], as portable.c's ``neg2log24``."""
    ix = m.to(torch.float32).view(torch.int32) - 0x4B3504F3  # m / 2^24 = 2^k f, f in [sqrt(1/2), sqrt(2))
    k = (ix >> 23).to(torch.float32)
    t = ((ix & 0x7FFFFF) + 0x3F3504F3).view(torch.float32) - 1.0
    z = t * t
    p = _estrin4(t, z, _LOG_P[:4]).mul_(z * z).add_(_estrin4(t, z, _LOG_P[4:8])).mul_(t).add_(_LOG_P[8])
    y = p.mul_(t).mul_(z).add_(k * _LN2_LO).add_(z * -0.5)  # log f = t - t^2/2 + t^3 P(t)
    return y.add_(t).add_(k * _LN2_HI).mul_(-2.0)


def _cos2pi24(j: torch.Tensor, quarters_back: torch.Tensor | int = 0) -> torch.Tensor:
    """``cos(2 pi j / 2^24 - quarters_back pi / 2)`` for int32 ``j`` in [0, 2^24): with
    ``quarters_back`` 1, the sine. As portable.c's ``cos_sin_2pi24``."""
    t = (j + (1 << 21)) & 0xFFFFFF  # an eighth of a turn on
    q = ((t >> 22) - quarters_back) & 3  # quadrant
    x = ((t & 0x3FFFFF) - (1 << 21)).to(torch.float32).mul_(_TWO_PI_2_24)  # angle in [-pi/4, pi/4)
    z = x * x
    z2 = z * z
    cos = _estrin4(z, z2, _COS).mul_(z).add_(1.0)
    sin = _estrin4(z, z2, _SIN).mul_(z).mul_(x).add_(x)
    v = torch.where((q & 1) == 1, sin, cos)
    return torch.where(((q + 1) & 2) != 0, -v, v)


def _cos_sin2pi24(j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``2 pi j / 2^24`` for int32 ``j`` in [0, 2^24): both of
    ``_cos2pi24``'s polynomials once, each answer picked by quadrant (portable.c's
    ``cos_sin_2pi24``)."""
    t = (j + (1 << 21)) & 0xFFFFFF
    q = t >> 22
    x = ((t & 0x3FFFFF) - (1 << 21)).to(torch.float32).mul_(_TWO_PI_2_24)
    z = x * x
    z2 = z * z
    cos = _estrin4(z, z2, _COS).mul_(z).add_(1.0)
    sin = _estrin4(z, z2, _SIN).mul_(z).mul_(x).add_(x)
    odd = (q & 1) == 1
    c, s = torch.where(odd, sin, cos), torch.where(odd, cos, sin)
    return torch.where(((q + 1) & 2) != 0, c.neg(), c), torch.where((q & 2) != 0, s.neg(), s)


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
            z = w.normal24()
        out = z.mul_(params["std"]).add_(params["mean"])
    elif kind == "bernoulli":
        out = (w.uniform01(dtype) < params["p"]).to(work)
    elif kind == "exponential":
        out = -torch.log1p(-w.uniform01(dtype)) / params["lambd"]
    elif kind == "cauchy":
        out = params["median"] + params["sigma"] * torch.tan(math.pi * (w.uniform01(dtype) - 0.5))
    elif kind == "log_normal":
        out = torch.exp(w.normal24().to(work).mul_(params["std"]).add_(params["mean"]))
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

    chunk = CHUNK if target.device.type == "cpu" else DEVICE_CHUNK

    def run(start: int) -> None:
        size = min(chunk, n - start)
        if flat is not None:
            piece = flat[start:start + size]
            values = sample(kind, stream, first + start, size, target.dtype, target.device, out=piece, **params)
            if values is not piece:  # no fused sampler for this kind and dtype
                piece.copy_(values)
        else:
            _strided_chunk(target, start, size).copy_(
                sample(kind, stream, first + start, size, target.dtype, target.device, **params))

    starts = range(0, n, chunk)
    serial = flat is None or fills_are_serial() or target.device.type != "cpu"  # a GPU gains nothing from threads
    workers = 1 if serial else min(torch.get_num_threads(), len(starts))
    if workers <= 1:
        for s in starts:
            run(s)
    else:  # chunks are independent: the split and the thread count cannot change a value
        with ThreadPoolExecutor(workers, "fxinit-portable") as pool:
            list(pool.map(run, starts))
    return target


def fill_runs(out: torch.Tensor, kind: str, stream: int, runs: Any, **params: float) -> bool:
    """Elements ``runs[i, 0] .. runs[i, 1]`` of the stream into ``out[runs[i, 2] ..]`` (``out``
    flat, contiguous, on the CPU) by one C call a run: the elements a copy draws itself
    (``plan.forwards``), often thousands of rows. False where the C kernel does not do this
    kind and dtype (the caller fills run by run)."""
    lib = portable_library() if out.device.type == "cpu" else None
    if lib is None or kind not in _AFFINE or out.dtype not in _FUSED_DTYPES or not out.is_contiguous():
        return False
    scale, shift = affine(kind, params)
    code, dtype, ptr, key = _KINDS.index(kind), _FUSED_DTYPES.index(out.dtype), out.data_ptr(), stream & _U64
    size = out.element_size()
    for lo, hi, at in runs.tolist():
        lib.fxinit_portable_fill(ptr + at * size, code, dtype, hi - lo, lo, key, float(scale), float(shift))
    return True


#: Fills of at most this many elements run batched on the CPU (``fill_batch``): one chunk,
#: which ``fill_`` would run on one thread as well.
BATCH_MAX = CHUNK


def batchable(dtype: torch.dtype, numel: int) -> bool:
    """Whether ``fill_batch`` takes a whole uniform or normal fill of ``numel`` elements of
    ``dtype`` on the CPU (fxinit's C kernel built here)."""
    return dtype in _FUSED_DTYPES and 0 < numel <= BATCH_MAX and portable_library() is not None


Job = tuple[torch.Tensor, str, int, float, float]  # out, kind, stream, scale, shift


def fill_batch(jobs: list[Job]) -> int:
    """``fill_(out, kind, stream)`` times ``scale`` plus ``shift`` of each ``(out, kind,
    stream, scale, shift)`` of ``jobs`` (contiguous CPU tensors, ``batchable``), in one call
    to the C kernel. Returns how many it filled, counted from the first (the first it cannot
    fill stops it); the caller fills the rest otherwise."""
    lib = portable_library()
    packed: list[int] = []
    params: list[float] = []
    for out, kind, stream, scale, shift in jobs:
        if (lib is None or kind not in _AFFINE or out.device.type != "cpu" or not out.is_contiguous()
                or not batchable(out.dtype, out.numel())):
            break
        packed += (out.data_ptr(), _KINDS.index(kind), _FUSED_DTYPES.index(out.dtype), out.numel(),
                   signed64(stream))
        params += (float(scale), float(shift))
    if packed:
        import numpy as np

        table, values = np.array(packed, dtype=np.int64), np.array(params, dtype=np.float64)
        lib.fxinit_portable_fill_batch(len(params) // 2, table.ctypes.data, values.ctypes.data)
    return len(params) // 2


def signed64(value: int) -> int:
    """``value`` as a signed 64-bit integer (kernels read its bits)."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


Piece = tuple[torch.Tensor, Any, int, float, float]  # out, runs (lo, hi, at), stream, scale, shift


def fill_table(pieces: list[Piece], row_elements: int) -> Any:
    """The table a GPU fill kernel reads (fxinit's Triton and CUDA kernels): for each
    ``(out, runs, stream, scale, shift)`` of ``pieces`` and each run ``(lo, hi, at)`` of its
    ``runs`` (elements ``lo .. hi`` of the stream go to ``out[at ..]``, ``out`` flat and
    contiguous), int64 rows ``(address, lo, hi, stream, scale, shift)``, ``scale`` and
    ``shift`` the bits of float32s (sign-extended), runs longer than ``row_elements`` cut into
    rows of that many elements, empty runs dropped."""
    import numpy as np

    rows = []
    for out, runs, stream, scale, shift in pieces:
        if not out.is_contiguous():
            raise ValueError("fxinit's fill kernels write contiguous tensors")
        runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        runs = runs[runs[:, 1] > runs[:, 0]]
        cuts = (runs[:, 1] - runs[:, 0] + row_elements - 1) // row_elements  # rows of each run
        run = np.repeat(runs, cuts, axis=0)
        offset = (np.arange(len(run), dtype=np.int64) - np.repeat(np.cumsum(cuts) - cuts, cuts)) * row_elements
        part = np.empty((len(run), 6), dtype=np.int64)
        part[:, 0] = out.data_ptr() + (run[:, 2] + offset) * out.element_size()
        part[:, 1] = run[:, 0] + offset
        part[:, 2] = np.minimum(part[:, 1] + row_elements, run[:, 1])
        part[:, 3] = signed64(stream)
        with np.errstate(over="ignore"):  # a scale past float32's range is an infinity, as torch rounds it
            part[:, 4:] = np.array([scale, shift], dtype=np.float32).view(np.int32).astype(np.int64)
        rows.append(part)
    return np.concatenate(rows) if rows else np.zeros((0, 6), dtype=np.int64)


def table_pairs(table: Any) -> int:
    """The Box-Muller pairs of ``fill_table``'s longest row (what a launch's blocks must cover)."""
    return int(((table[:, 2] - 1) // 2 - table[:, 1] // 2 + 1).max())


def on_device(table: Any, device: torch.device) -> torch.Tensor:
    """``fill_table``'s ``table`` on ``device``, without waiting for the GPU: a copy from pinned
    memory, asynchronous (torch's pinned-memory allocator keeps the memory until the copy ran;
    a copy from pageable memory would wait for every kernel queued before it)."""
    rows = torch.from_numpy(table)
    if device.type != "cuda":
        return rows.to(device)
    return rows.pin_memory().to(device, non_blocking=True)


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


def fills_are_serial() -> bool:
    """Whether this thread is inside ``serial_fills``."""
    return getattr(_THREAD, "serial", False)


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
