"""torch's CPU ``uniform_`` and ``normal_`` fills, bit for bit, in compiled code.

The kernels (``fills.c``) reproduce what the installed torch computes from its MT19937
generator, for the code path the running torch dispatches to (``DEFAULT``, or the AVX2
kernels that ``AVX2`` and ``AVX512`` builds run for these two ops). A range of a tensor
starts from the generator state jumped to its first word (:func:`fxinit.rng.mt19937.advance`),
so a fill splits over threads, and a shard can fill only its own slice.

Nothing is trusted blindly: the first use of each (kind, dtype, path) compares the kernel
with torch on sizes that cross every threshold of torch's samplers (and each new pair of
parameters on a few sizes); on any difference, or where the kernel cannot be built, that
kind is refused (``native_fill`` returns False) and the caller uses torch. What a check found
is remembered in the kernel cache for later processes running the same kernel build, torch
build and CPU (a fresh process would otherwise spend ~12 ms checking again).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from fxinit.rng.mt19937 import JUMP_MIN_TWISTS, CpuState, advance
from fxinit.rng.native import _load, cache_dir

_SOURCE = Path(__file__).with_name("fills.c")
_OPS = {"uniform": 0, "normal": 1}
_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
# normal_ has no AVX-512 kernel (REGISTER_NO_AVX512_DISPATCH): AVX-512 builds run the AVX2
# one; uniform_ is compiled for both with the same fused multiply-add
_PATHS = {"DEFAULT": 0, "AVX2": 1, "AVX512": 1}
MIN_PER_THREAD = 1 << 16  # elements: below this a thread's jump costs more than it saves
_log = logging.getLogger("fxinit")


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded fill kernels, or None where they cannot be built here."""
    lib = _load(_SOURCE)
    if lib is None:
        return None
    lib.fxinit_fill.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_double, ctypes.c_double]
    lib.fxinit_fill.restype = ctypes.c_int
    lib.fxinit_fill_runs.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                     ctypes.c_double, ctypes.c_double]
    lib.fxinit_fill_runs.restype = ctypes.c_int64
    lib.fxinit_fill_batch.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.fxinit_fill_batch.restype = ctypes.c_int64
    lib.fxinit_fill_supported.argtypes = [ctypes.c_int]
    lib.fxinit_fill_supported.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=None)
def torch_path() -> int | None:
    """The kernel path of the running torch (0 DEFAULT, 1 AVX2), None where unsupported."""
    path = _PATHS.get(torch.backends.cpu.get_cpu_capability())
    lib = library()
    if path is None or lib is None or not lib.fxinit_fill_supported(path):
        return None
    return path


def words_per_element(kind: str, dtype: torch.dtype) -> int:
    """Generator words per uniform sample: 2 for float64 (53-bit), else 1."""
    return 2 if dtype == torch.float64 else 1


def draws(kind: str, dtype: torch.dtype, total: int) -> int:
    """Words ``torch.empty(total, dtype).<kind>_()`` consumes (normal: total >= 16)."""
    a = words_per_element(kind, dtype)
    if kind == "uniform" or total % 16 == 0:
        return a * total
    if dtype in (torch.float32, torch.float64):  # every uniform, then a redrawn last block
        return a * (total + 16)
    return a * (total // 16 * 16 + 16)  # reduced types draw whole blocks only


# --------------------------------------------------------------------------- filling

_Job = tuple[int, int, int, int]  # first, lo, hi (relative to out's element 0), word offset


def _jobs(kind: str, dtype: torch.dtype, n: int, start: int, total: int, threads: int,
          min_chunk: int = MIN_PER_THREAD) -> list[_Job]:
    a = words_per_element(kind, dtype)
    if n > 0 and (kind == "uniform" or total % 16 == 0) and (threads <= 1 or n < 2 * min_chunk):
        return [(0, 0, n, a * start)]  # one job, no redrawn tail: most of a model's fills
    end = start + n
    tail: list[_Job] = []
    stop = end
    if kind == "normal" and total % 16:
        clip = total - 16  # torch overwrites the last 16 elements with a redrawn block
        stop = min(end, clip)
        if end > clip:
            t0 = total if dtype in (torch.float32, torch.float64) else total // 16 * 16
            tail = [(clip - start, max(clip, start) - start, n, a * t0)]
    jobs: list[_Job] = []
    m = stop - start
    if m > 0:
        parts = max(1, min(threads, m // min_chunk))
        cuts = [start + (m * i // parts) // 16 * 16 for i in range(parts)] + [stop]
        for lo, hi in zip(cuts, cuts[1:]):
            if hi > lo:
                jobs.append((lo - start, lo - start, hi - start, a * lo))
    return jobs + tail


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:
    """A forked child has the pool object but none of its threads: it makes its own."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="fxinit-fill")
        return _POOL


def _kernel(op: int, dtype: int, path: int, ptr: int, job: _Job, words: np.ndarray, consumed: int,
            p0: float, p1: float) -> int:
    lib = library()
    assert lib is not None
    first, lo, hi, _ = job
    return lib.fxinit_fill(op, dtype, path, ptr, first, lo, hi, words.ctypes.data, consumed, p0, p1)


_kernel_call: Callable[..., int] = _kernel  # tests swap this to make the kernel disagree


def _fill(kind: str, out: torch.Tensor, state: torch.Tensor, params: tuple[float, float], start: int,
          total: int, threads: int, path: int, min_chunk: int = MIN_PER_THREAD) -> bool:
    jobs = _jobs(kind, out.dtype, out.numel(), start, total, threads, min_chunk)
    states = [CpuState.words_of(advance(state, job[3]) if job[3] else state) for job in jobs]
    op, dt, ptr = _OPS[kind], _DTYPES[out.dtype], out.data_ptr()
    p0, p1 = float(params[0]), float(params[1])
    call = _kernel_call

    def one(i: int) -> int:
        return call(op, dt, path, ptr, jobs[i], states[i][0], states[i][1], p0, p1)

    if len(jobs) == 1:
        return one(0) == 0
    futures = [_pool().submit(one, i) for i in range(1, len(jobs))]
    rc = one(0)
    return all(f.result() == 0 for f in futures) and rc == 0


# --------------------------------------------------------------------------- self-check

_CHECK_SIZES = (*range(1, 41), 64, 65, 1000, 1007, 4097, 65536 + 3)
_QUICK_SIZES = (17, 1007, 4097)
_checked: dict[tuple, bool] = {}  # (kind, dtype, path) -> passed the full check
_params_checked: dict[tuple, bool] = {}  # (kind, dtype, path, params) -> passed the quick check
_CHECK_LOCK = threading.RLock()


def _compare(kind: str, dtype: torch.dtype, path: int, params: tuple[float, float], size: int,
             rng: random.Random) -> bool | None:
    """One comparison with torch on a random state and a random piece of a ``size`` fill;
    None where torch itself refuses the parameters."""
    g = torch.Generator()
    g.manual_seed(rng.randrange(1 << 62))
    torch.empty(rng.randrange(0, 700), dtype=torch.float32).uniform_(generator=g)  # any position
    state = g.get_state()
    expect = torch.empty(size, dtype=dtype)
    try:
        getattr(expect, kind + "_")(*params, generator=g)
    except (RuntimeError, ValueError, OverflowError):
        return None
    step = 16 if kind == "normal" else 1
    start = rng.randrange(0, size, step) if rng.random() < 0.5 else 0
    stop = rng.randrange(start + 1, size + 1) if rng.random() < 0.3 else size
    out = torch.full((stop - start,), float("nan"), dtype=dtype)
    threads = rng.choice((1, 2, 3))  # small pieces: the split and the jumps are checked too
    if not _fill(kind, out, state, params, start, size, threads, path, min_chunk=32):
        return False
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[dtype.itemsize]
    return torch.equal(out.view(as_int), expect[start:stop].view(as_int))


def _passes(kind: str, dtype: torch.dtype, path: int, params: tuple[float, float],
            sizes: tuple[int, ...]) -> bool | None:
    """True if the kernel equals torch on all ``sizes``; None if torch refuses ``params``."""
    rng = random.Random(f"{kind}{dtype}{path}{params}")
    try:
        for size in sizes:
            if kind == "normal" and size < 16:
                continue
            same = _compare(kind, dtype, path, params, size, rng)
            if same is None:
                return None
            if not same:
                _log.debug("native %s_ %s (path %d, params %s) differs from torch at size %d: using torch",
                           kind, dtype, path, params, size)
                return False
    except Exception as exc:  # noqa: BLE001 - any failure of ours: torch does the fill
        _log.debug("native %s_ %s self-check failed: %r", kind, dtype, exc)
        return False
    return True


def _trusted(kind: str, dtype: torch.dtype, path: int, params: tuple[float, float]) -> bool:
    """Whether the kernel passed its checks for this kind/dtype/path and these parameters
    (checking now if not done yet, or reading what an earlier process found with the same
    kernel, torch and CPU: ``_remembered``). A difference distrusts the kind for good."""
    key = (kind, dtype, path)
    pkey = (*key, params)
    if _params_checked.get(pkey) and _checked.get(key):  # checked already (no lock: a model asks thousands of times)
        return True
    with _CHECK_LOCK:
        earlier = _remembered()
        first = key not in _checked
        if first:
            base = (0.0, 1.0) if kind == "normal" else (-0.37, 0.91)
            _checked[key] = _remember(earlier, (*key, base), lambda: _passes(kind, dtype, path, base, _CHECK_SIZES))
        if not _checked[key]:
            return False
        if pkey not in _params_checked:
            if len(_params_checked) > 4096:
                _params_checked.clear()
            sizes = _CHECK_SIZES if first else _QUICK_SIZES
            same = _remember(earlier, (*pkey, "full" if first else "quick"),
                             lambda: _passes(kind, dtype, path, params, sizes))
            if same is False:
                _checked[key] = False
            _params_checked[pkey] = same is True
        return _params_checked[pkey] and _checked[key]


def _remembered() -> dict[str, bool | None] | None:
    """What earlier processes' checks found for this build of the kernel, this torch and this
    CPU (a JSON file in the kernel cache, named by all three), or None where nothing is
    remembered: the kernel is not the real one (tests swap it) or the file cannot be used."""
    if _kernel_call is not _kernel or _MEMORY_OFF:
        return None
    global _MEMORY
    if _MEMORY is None:
        lib = library()
        try:  # the first CPU's flags: reading no further (a many-core machine lists hundreds)
            with open("/proc/cpuinfo") as cpuinfo:
                flags = next((line.rstrip("\n") for line in cpuinfo if line.startswith("flags")), "")
        except OSError:
            flags = ""
        tag = hashlib.sha256("\0".join((getattr(lib, "_name", ""), torch.__version__, str(torch.version.git_version),
                                        str(torch.backends.cpu.get_cpu_capability()), flags)).encode()).hexdigest()[:16]
        path = cache_dir() / f"fills-checks-{tag}.json"
        try:
            found = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            found = {}
        if not isinstance(found, dict) or len(found) > REMEMBERED_MAX:  # grown by other parameters: start again
            found = {}
        _MEMORY = (path, found)
    return _MEMORY[1]


_MEMORY: tuple[Path, dict[str, bool | None]] | None = None
#: Checks remembered at most: a model asks for a handful of parameter sets, and every process
#: reads the whole file before its first fill (4096 of them took 1.3 ms to parse).
REMEMBERED_MAX = 512
_MEMORY_OFF = False  # after reset_checks: this process checks for itself


def _remember(earlier: dict[str, bool | None] | None, key: tuple, check: Callable[[], bool | None]) -> bool | None:
    """The result of ``check`` for ``key``: remembered from an earlier process, else run and
    written down for later ones."""
    name = repr(key)
    if earlier is not None and name in earlier:
        return earlier[name]
    result = check()
    if earlier is not None and _MEMORY is not None and result is not False:  # a difference is checked again
        if len(earlier) >= REMEMBERED_MAX:
            earlier.clear()
        earlier[name] = result
        try:
            _MEMORY[0].parent.mkdir(parents=True, exist_ok=True)
            tmp = _MEMORY[0].with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(earlier))
            os.replace(tmp, _MEMORY[0])  # atomic: concurrent processes each write a whole file
        except OSError:
            pass
    return result


def reset_checks() -> None:
    """Forget the self-check results, and check for this process alone from now on (tests)."""
    global _MEMORY_OFF
    with _CHECK_LOCK:
        _checked.clear()
        _params_checked.clear()
        _MEMORY_OFF = True


# --------------------------------------------------------------------------- API

def _usable(kind: str, out: torch.Tensor, state: torch.Tensor, total: int,
            params: tuple[float, float]) -> tuple[int, tuple[float, float]] | None:
    """``(path, params as floats)`` where the kernel may fill ``out`` (a contiguous CPU tensor
    of a supported dtype) for a ``kind`` fill of ``total`` elements from ``state``: this CPU
    and torch have a path, and the kernel passed its checks; else None."""
    if kind not in _OPS or out.dtype not in _DTYPES or out.device.type != "cpu" or not out.is_contiguous():
        return None
    if state.numel() != 5056 or (kind == "normal" and total < 16):
        return None
    path = torch_path()
    if path is None:
        return None
    params = (float(params[0]), float(params[1]))
    return (path, params) if _trusted(kind, out.dtype, path, params) else None


def native_fill(kind: str, out: torch.Tensor, state: torch.Tensor, params: tuple[float, float],
                start: int = 0, total: int | None = None, threads: int | None = None) -> bool:
    """Write into ``out`` (a contiguous CPU tensor, float32/float64/bfloat16/float16) the
    elements ``start .. start+out.numel()`` of what ``torch.empty(total, dtype).<kind>_(*params,
    generator=g)`` gives, ``g`` a generator in ``state`` (a ``get_state()`` tensor).

    ``kind``: ``"normal"`` (params mean, std) or ``"uniform"`` (params from, to). ``start``
    must be a multiple of 16 for normal, whose ``total`` must be at least 16 (torch's
    smaller fills use another sampler); ``total`` defaults to ``start + out.numel()``.
    Returns False (writing nothing meaningful) when this kind/dtype/path is not supported
    or failed its self-check; the caller then uses torch.
    """
    n = out.numel()
    total = start + n if total is None else total
    if start < 0 or start + n > total or (kind == "normal" and start % 16):
        return False
    usable = _usable(kind, out, state, total, params)
    if usable is None:
        return False
    path, params = usable
    if n == 0:
        return True
    threads = torch.get_num_threads() if threads is None else max(1, int(threads))
    return _fill(kind, out, state, params, start, total, threads, path)


#: Fills of fewer elements run as one job each (``_jobs``): ``native_fill_batch`` takes them.
BATCH_BELOW = 2 * MIN_PER_THREAD


def batchable(kind: str, dtype: torch.dtype, numel: int) -> bool:
    """Whether ``native_fill_batch`` can take a whole ``kind`` fill of ``numel`` elements of
    ``dtype`` (one job from element 0: a normal fill a multiple of 16 long, as torch redraws
    a shorter last block), its checks aside."""
    return kind in _OPS and dtype in _DTYPES and 0 < numel < BATCH_BELOW and (
        kind == "uniform" or numel % 16 == 0)


#: Elements a batch's thread gets at least (``native_fill_batch``): below, waking a thread costs more.
BATCH_PER_THREAD = 1 << 17


def native_fill_batch(fills: Sequence[tuple[str, torch.Tensor, torch.Tensor, tuple[float, float]]],
                      threads: int | None = None) -> int:
    """``native_fill(kind, out, state, params)`` of each ``(kind, out, state, params)``, in order,
    in calls to the kernel of many fills each: a model's hundreds of small fills without a call
    each, split by elements over up to ``threads`` threads (default torch's thread count). Each
    ``out`` must be a contiguous CPU tensor of fewer than ``BATCH_BELOW`` elements, and for
    normal a multiple of 16 of them. Returns how many it filled, counted from the first
    (the first it cannot fill stops it); the caller fills the rest otherwise (some after it
    may be filled already, with the same values)."""
    lib = library()
    jobs: list[int] = []
    params: list[float] = []
    elements = 0
    for kind, out, state, p in fills:
        n = out.numel()
        usable = _usable(kind, out, state, n, p) if batchable(kind, out.dtype, n) else None
        if usable is None or lib is None:
            break
        jobs += (_OPS[kind], _DTYPES[out.dtype], usable[0], out.data_ptr(), n, state.data_ptr())
        params += usable[1]
        elements += n
    if not jobs:
        return 0
    packed, values = np.array(jobs, dtype=np.int64).reshape(-1, 6), np.array(params, dtype=np.float64)
    threads = torch.get_num_threads() if threads is None else max(1, int(threads))
    parts = max(1, min(threads, elements // BATCH_PER_THREAD, len(packed)))
    cuts = np.searchsorted(np.cumsum(packed[:, 4]), [elements * k // parts for k in range(1, parts)], side="right")
    bounds = [0, *(int(c) for c in cuts), len(packed)]

    def part(k: int) -> int:  # the fills done of part k, counted from its first
        lo, hi = bounds[k], bounds[k + 1]
        if hi <= lo:
            return 0
        return int(lib.fxinit_fill_batch(hi - lo, packed[lo:].ctypes.data, values[2 * lo:].ctypes.data))

    futures = [_pool().submit(part, k) for k in range(1, parts)]  # ctypes lets go of the GIL meanwhile
    try:
        first = part(0)
    finally:  # the threads write into the caller's tensors: never return (or raise) before they end
        wait(futures)
    done = [first, *(f.result() for f in futures)]
    filled = 0
    for k, d in enumerate(done):
        filled += d
        if d < bounds[k + 1] - bounds[k]:
            break
    return filled


#: A run of a fill's elements drawn into scattered places (``native_fill_runs``) starts at a
#: state jumped to it rather than twisted to, past this many words from the previous run.
RUNS_JUMP_WORDS = JUMP_MIN_TWISTS * 624


def native_fill_runs(kind: str, out: torch.Tensor, state: torch.Tensor, params: tuple[float, float],
                     runs: np.ndarray, total: int, threads: int | None = None) -> bool:
    """Write elements ``runs[i, 0] .. runs[i, 1]`` of what ``torch.empty(total, dtype).<kind>_(
    *params, generator=g)`` gives into ``out[runs[i, 2] ..]`` (``out`` a contiguous 1-D CPU
    tensor; ``g`` a generator in ``state``), for every run: the elements a copy draws itself
    (``plan.forwards``). Runs are sorted by their first element and disjoint. One pass of
    the generator serves runs that do not share a block of 16 (normal); the last, redrawn
    block of a normal fill is drawn apart. False (nothing meaningful written) as for
    ``native_fill``; the caller then draws them otherwise."""
    n = out.numel()
    runs = np.ascontiguousarray(runs, dtype=np.int64).reshape(-1, 3)
    if out.dim() != 1 or len(runs) and (runs[:, 0].min() < 0 or runs[:, 1].max() > total or runs[:, 2].min() < 0
                                        or (runs[:, 2] + runs[:, 1] - runs[:, 0]).max() > n
                                        or (runs[:, 1] < runs[:, 0]).any()):
        return False
    usable = _usable(kind, out, state, total, params)
    if usable is None:
        return False
    path, params = usable
    runs = runs[runs[:, 1] > runs[:, 0]]
    clip = total - 16 if kind == "normal" and total % 16 else total
    if (runs[:, 1] > clip).any():  # the redrawn last block: through native_fill, apart
        last = runs[runs[:, 1] > clip]
        base = clip - clip % 16
        scratch = torch.empty(total - base, dtype=out.dtype)
        if not native_fill(kind, scratch, state, params, start=base, total=total, threads=1):
            return False
        for lo, hi, at in last.tolist():
            lo2 = max(lo, base)
            out[at + lo2 - lo:at + hi - lo].copy_(scratch[lo2 - base:hi - base])
        runs = np.concatenate([runs[runs[:, 1] <= clip], _clipped(last, base)])
        runs = runs[np.argsort(runs[:, 0], kind="stable")]
    threads = torch.get_num_threads() if threads is None else max(1, int(threads))
    jobs = [job for passes in _passes_of(runs, kind) for job in _runs_jobs(passes, kind, out.dtype, threads)]
    op, dt, ptr = _OPS[kind], _DTYPES[out.dtype], out.data_ptr()

    def one(job: np.ndarray) -> int:
        first = int(job[0, 0]) - int(job[0, 0]) % (16 if kind == "normal" else 1)
        s = CpuState.of(advance(state, words_per_element(kind, out.dtype) * first) if first else state)
        words = np.ascontiguousarray(s.words, dtype=np.uint32)
        job = np.ascontiguousarray(job)
        return library().fxinit_fill_runs(op, dt, path, ptr, job.ctypes.data, len(job), words.ctypes.data,
                                          s.consumed, first, *params)

    if len(jobs) <= 1 or threads == 1:
        return all(one(job) == 0 for job in jobs)
    futures = [_pool().submit(one, job) for job in jobs[1:]]
    rc = one(jobs[0])
    return all(f.result() == 0 for f in futures) and rc == 0


def _clipped(runs: np.ndarray, base: int) -> np.ndarray:
    """The parts of ``runs`` before element ``base``."""
    runs = runs[runs[:, 0] < base].copy()
    runs[:, 1] = np.minimum(runs[:, 1], base)
    return runs


def _passes_of(runs: np.ndarray, kind: str) -> list[np.ndarray]:
    """``runs`` in as few groups as one generator pass each can draw: a run that starts where
    an earlier run of its group reached (the same elements copied twice, or for normal the
    same block of 16) goes to another group."""
    if len(runs) < 2:
        return [runs] if len(runs) else []
    block = 16 if kind == "normal" else 1
    first = runs[:, 0] - runs[:, 0] % block
    reached = (runs[:, 1] + block - 1) // block * block
    if (first[1:] >= reached[:-1]).all():
        return [runs]
    groups: list[list[int]] = []
    ends: list[int] = []
    for i in range(len(runs)):
        g = next((j for j, end in enumerate(ends) if first[i] >= end), None)
        if g is None:
            groups.append([])
            ends.append(0)
            g = len(groups) - 1
        groups[g].append(i)
        ends[g] = int(reached[i])
    return [runs[idx] for idx in groups]


def _runs_jobs(runs: np.ndarray, kind: str, dtype: torch.dtype, threads: int) -> list[np.ndarray]:
    """One pass of runs cut where the generator jumps rather than twists (long gaps), and
    into about ``threads`` parts of equal elements when there are enough of them."""
    if not len(runs):
        return []
    a = words_per_element(kind, dtype)
    cuts = set((np.flatnonzero(a * (runs[1:, 0] - runs[:-1, 1]) > RUNS_JUMP_WORDS) + 1).tolist())
    sizes = np.cumsum(runs[:, 1] - runs[:, 0])
    parts = max(1, min(threads, int(sizes[-1]) // MIN_PER_THREAD))
    cuts |= {int(i) for i in np.searchsorted(sizes, [sizes[-1] * p // parts for p in range(1, parts)], side="right")}
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(runs)), len(runs)]
    return [runs[lo:hi] for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
