"""When torch's CPU samplers can fill part of a tensor with the values a whole fill gives there.

A piece of a fill starts from the generator state advanced past the words the elements
before it consume. That is trusted only for calls whose per-element draw model is known
(``rng.draws``: no fixed prefix, a whole number of words per element) and for which a
probe on the installed torch shows that pieces equal the same elements of a whole fill.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from fxinit.rng import mt19937
from fxinit.rng.draws import draw_model
from fxinit.rng.snapshot import RngSnapshot, private_generator

#: Elements per piece of a fill run in chunks: a multiple of 16, cache-sized.
CHUNK = 1 << 16

_PROBE_N = 1000 + 7
_verified: dict[Any, bool] = {}


def splittable(func: Any, rest: tuple, kwargs: dict, dtype: torch.dtype, n: int) -> tuple[int, int] | None:
    """``(words per element, tail block words)`` when pieces of the fill ``func(t, *rest,
    **kwargs)`` of ``n`` elements of ``dtype`` can be generated apart with the whole fill's
    bits: a calibrated draw model with no fixed prefix, and a probe that agrees; else None."""
    meta = torch.empty(n, dtype=dtype, device="meta")
    model = draw_model(func, (meta, *rest), kwargs, meta)
    if model is None:
        return None
    a, r, b, t = model
    if r != 1 or b != 0 or t not in (0, 16 * a) or not _piecewise_ok(func, dtype, rest, kwargs):
        return None
    return a, t


def widen(lo: int, hi: int, n: int, tail: int) -> tuple[int, int]:
    """Samplers that work in blocks of 16 (``normal_``: ``tail`` words) need block-aligned
    pieces, and a piece reaching into the last, recomputed block must run to the end and
    start 16 elements or more before it: a piece is drawn as a whole fill of its own length
    from the generator state at its start, and a fill of fewer than 16 elements is drawn
    by another sampler."""
    if not tail:
        return lo, hi
    lo -= lo % 16
    hi = min(n, -(-hi // 16) * 16)
    if n % 16 and hi > n - n % 16 - 16:
        hi = n
        lo = min(lo, (n - 16) // 16 * 16)
    return lo, hi


def chunk_bounds(n: int, blocks: bool, size: int = CHUNK) -> list[tuple[int, int]]:
    """Pieces of ``size`` elements (a multiple of 16) covering ``0 .. n``; with ``blocks`` (a
    sampler working in blocks of 16 that recomputes the last one), the last piece takes the
    tail block."""
    bounds, lo = [], 0
    while lo < n:
        lo, hi = widen(lo, min(n, lo + size), n, 16 if blocks else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


@lru_cache(maxsize=None)
def trunc_normal_is_normal(dtype: torch.dtype) -> bool:
    """Whether the installed torch's ``nn.init.trunc_normal_`` of ``dtype``, with bounds no
    value can reach, draws exactly what ``normal_`` draws and leaves the generator where it
    does (torch 2.12+: ``normal_``, then whole tensors redrawn while a value is out of
    bounds; torch 2.11's inverse-CDF method does not), probed on sizes across the samplers'
    thresholds."""
    try:
        for n in (1, 7, 15, 16, 17, 100, 1007, 4097):
            a, b = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
            got = torch.empty(n, dtype=dtype)
            torch.nn.init.trunc_normal_(got, 0.25, 0.02, -2.0, 2.0, generator=a)
            want = torch.empty(n, dtype=dtype).normal_(0.25, 0.02, generator=b)
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)) or \
                    not torch.equal(a.get_state(), b.get_state()):
                return False
        return True
    except Exception:
        return False


def _piecewise_ok(func: Any, dtype: torch.dtype, rest: tuple, kwargs: dict) -> bool:
    """Probe once per kind of call: pieces of a fill equal the same elements of a whole fill."""
    key = (func, dtype, repr(rest), repr(sorted((k, v) for k, v in kwargs.items() if k != "generator")))
    if key not in _verified:
        _verified[key] = _probe(func, dtype, rest, kwargs)
    return _verified[key]


def _probe(func: Any, dtype: torch.dtype, rest: tuple, kwargs: dict) -> bool:
    try:
        gen = torch.Generator()
        gen.manual_seed(2024)
        state = gen.get_state()
        whole = torch.empty(_PROBE_N, dtype=dtype)
        func(whole, *rest, **{**kwargs, "generator": gen})
        probe_target = torch.empty(_PROBE_N, dtype=dtype, device="meta")
        model = draw_model(func, (probe_target, *rest), kwargs, probe_target)
        if model is None:
            return False
        a, _, _, t = model
        for lo, hi in ((512, 800), (512, _PROBE_N), (0, 96), (64, 1000)):
            lo, hi = widen(lo, hi, _PROBE_N, t)
            piece = torch.empty(hi - lo, dtype=dtype)
            g = private_generator(RngSnapshot(device="cpu", state=mt19937.advance(state, a * lo)))
            func(piece, *rest, **{**kwargs, "generator": g})
            if not torch.equal(piece.view(torch.uint8 if dtype.itemsize == 1 else piece.dtype),
                               whole[lo:hi].view(torch.uint8 if dtype.itemsize == 1 else whole.dtype)):
                return False
        return True
    except Exception:
        return False
