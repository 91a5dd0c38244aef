"""PyTorch's CPU generator state, read and advanced outside torch.

``torch.Generator.get_state()`` on CPU returns the bytes of ``CPUGeneratorImplState``:
the MT19937 words and position, plus the cached second samples of the scalar normal
sampler. A random op whose only effect on that state is to consume ``n`` words (a
*pure advance*) can be skipped by advancing the words here, which is what lets capture
record random ops without drawing them and lets materialization start any op anywhere.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fxinit.rng.native import library

N = 624
_STATE_BYTES = 5056
_LEFT = slice(8, 12)
_NEXT = slice(16, 24)
_WORDS = slice(24, 24 + 8 * N)  # uint64 slots holding 32-bit words
_CACHES = slice(24 + 8 * N, _STATE_BYTES)  # normal_x/y/rho, validity flags, float sample


@dataclass
class CpuState:
    """An unpacked CPU generator state: ``consumed`` words of the current ``words`` block
    were used (624 means the next draw twists first)."""

    raw: np.ndarray  # the full state bytes, kept for the seed and the normal caches
    words: np.ndarray  # uint32[624]
    consumed: int

    @staticmethod
    def of(state: torch.Tensor) -> "CpuState":
        raw = state.numpy().copy() if state.device.type == "cpu" else state.cpu().numpy().copy()
        if raw.size != _STATE_BYTES:
            raise ValueError(f"not a CPU generator state: {raw.size} bytes")
        left = int(raw[_LEFT].view(np.int32)[0])
        words = raw[_WORDS].view(np.uint64).astype(np.uint32)
        return CpuState(raw, words, N + 1 - left)

    @staticmethod
    def words_of(state: torch.Tensor) -> tuple[np.ndarray, int]:
        """``(words, consumed)`` of a CPU generator state, without the copy ``of`` keeps."""
        raw = state.numpy() if state.device.type == "cpu" else state.cpu().numpy()
        if raw.size != _STATE_BYTES:
            raise ValueError(f"not a CPU generator state: {raw.size} bytes")
        return raw[_WORDS].view(np.uint64).astype(np.uint32), N + 1 - int(raw[_LEFT].view(np.int32)[0])

    def to_tensor(self) -> torch.Tensor:
        raw = self.raw.copy()
        raw[_WORDS] = self.words.astype(np.uint64).view(np.uint8)
        raw[_LEFT] = np.array([N + 1 - self.consumed], dtype=np.int32).view(np.uint8)
        raw[_NEXT] = np.array([self.consumed % (N + 1)], dtype=np.uint64).view(np.uint8)
        raw[12:16] = np.array([1], dtype=np.int32).view(np.uint8)  # seeded
        return torch.from_numpy(raw)

    def same_caches(self, other: "CpuState") -> bool:
        return bool(np.array_equal(self.raw[_CACHES], other.raw[_CACHES]))


# Above this many twists (~40M draws) a polynomial jump beats twisting.
JUMP_MIN_TWISTS = 1 << 12  # below this, twisting (~0.35 us a block) beats a jump (~0.5 ms + polynomial)
JUMP_QUANTUM = 1 << 10  # jumps are whole multiples of this many blocks: their polynomials repeat and cache
_DEG = 19937


# The kernel finds the characteristic polynomial on its first call and keeps it in C
# globals; ctypes releases the GIL, so calls from the materialization threads are serialized.
_XPOW = threading.Lock()


@lru_cache(maxsize=256)  # a model repeats its tensor sizes: jumps repeat their lengths
def _jump_polynomial(words: int) -> np.ndarray | None:
    """x^words mod the generator's characteristic polynomial, or None without the kernel."""
    lib = library()
    q = np.zeros(_DEG // 64 + 1, dtype=np.uint64)
    if lib is None:
        return None
    with _XPOW:
        failed = lib.fxinit_mt_xpow(ctypes.c_uint64(words), q.ctypes.data_as(ctypes.c_void_p)) != 0
    if failed:
        return None
    q.setflags(write=False)
    return q


def _twist(words: np.ndarray, times: int) -> np.ndarray:
    """``times`` MT19937 state twists of a copy of ``words``."""
    out = np.ascontiguousarray(words, dtype=np.uint32).copy()
    if times == 0:
        return out
    lib = library()
    if lib is not None:
        ptr = out.ctypes.data_as(ctypes.c_void_p)
        jump = (times - 1) // JUMP_QUANTUM * JUMP_QUANTUM if times > JUMP_MIN_TWISTS else 0
        q = _jump_polynomial(jump * N) if jump else None
        if q is not None:  # move the words ``jump`` blocks ahead, then twist exactly the rest (>= 1)
            lib.fxinit_mt_jump(ptr, q.ctypes.data_as(ctypes.c_void_p))
            times -= jump
        lib.fxinit_mt_twist(ptr, ctypes.c_uint64(times))
        return out
    bitgen = np.random.MT19937()
    bitgen.state = {"bit_generator": "MT19937", "state": {"key": out, "pos": N}}
    remaining = times * N - 1  # the first draw twists once; leave the last block fully unread
    bitgen.random_raw(1)
    while remaining:
        step = min(remaining, 1 << 20)
        bitgen.random_raw(step)
        remaining -= step
    return np.asarray(bitgen.state["state"]["key"], dtype=np.uint32).copy()


def advance(state: torch.Tensor, draws: int) -> torch.Tensor:
    """The CPU generator state after ``draws`` more 32-bit words, caches untouched."""
    if draws < 0:
        raise ValueError("cannot advance a generator backwards")
    lib = library()
    if lib is not None and draws <= JUMP_MIN_TWISTS * N and state.device.type == "cpu" and state.is_contiguous() \
            and state.numel() == _STATE_BYTES:  # in C on a copy: no unpacking
        out = state.clone()
        lib.fxinit_mt_state_advance(ctypes.c_void_p(out.data_ptr()), ctypes.c_uint64(draws))
        return out
    s = CpuState.of(state)
    total = s.consumed + draws
    if total <= N:
        s.consumed = total
        return s.to_tensor()
    twists = (total - 1) // N  # the block holding the last consumed word
    s.words = _twist(s.words, twists)
    s.consumed = total - twists * N
    return s.to_tensor()


def advance_in_place(state: torch.Tensor, draws: int) -> None:
    """``state`` (a CPU generator state tensor) moved ``draws`` words ahead in place, as
    drawing them would (caches untouched): a few microseconds plus ~0.35 us per 624 words."""
    lib = library()
    if lib is None or draws > JUMP_MIN_TWISTS * N:
        state.copy_(advance(state, draws))
        return
    lib.fxinit_mt_state_advance(ctypes.c_void_p(state.data_ptr()), ctypes.c_uint64(draws))


def distance(before: torch.Tensor, after: torch.Tensor, max_twists: int = 64) -> int | None:
    """How many words took the generator from ``before`` to ``after``, if that was a pure
    advance of at most ``max_twists`` blocks; None otherwise."""
    a, b = CpuState.of(before), CpuState.of(after)
    if not a.same_caches(b) or not np.array_equal(a.raw[:8], b.raw[:8]):
        return None
    words = a.words
    for twists in range(max_twists + 1):
        if np.array_equal(words, b.words):
            d = twists * N + b.consumed - a.consumed
            if d >= 0:
                return d
        words = _twist(words, 1)
    return None
