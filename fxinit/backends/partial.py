"""Filling only part of a random tensor, with the values the whole fill would give there.

Used for the ranges found by ``passes.ranges`` (a rank reading its shard of a full
tensor). Portable mode: the stream is indexed by element, so a piece is just the stream's
elements ``lo .. hi``. Exact mode: the piece starts from the generator state advanced past
the words the elements before it consume; this is trusted only for op kinds whose
per-element draw model is known and for which a probe on the installed torch shows that
the piece equals the same elements of a whole fill.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from fxinit.rng import RngSnapshot, Snapshot, mt19937, private_generator
from fxinit.rng.draws import MIN_ELEMENTS, draw_model

_PROBE_N = 1000 + 7
_verified: dict[Any, bool] = {}

CHUNK = 1 << 16  # elements per piece of a chunked fill: a multiple of 16, cache-sized
#: Gaps between read ranges shorter than this are drawn rather than skipped: a skip costs
#: ~60 us of generator handling, drawing ~4 ns an element (measured, CPU mt19937 normal_).
SKIP_MIN = 1 << 14


def fill_piece_exact(node: fx.Node, args: tuple, kwargs: dict, rng: Mapping[str, Snapshot],
                     ranges: list[tuple[int, int]]) -> bool:
    """Fill the elements in ``ranges`` (sorted, disjoint; widened as the sampler needs) of
    ``args[0]`` as the whole op would; False (nothing done) when that cannot be done exactly.

    One private generator goes from range to range: past the elements between two ranges
    it is advanced without generating them (``mt19937.advance``, a fraction of the cost)."""
    target = args[0]
    keys = node.meta.get("generators") or {}
    if set(keys) != {"gen"} or not isinstance(target, torch.Tensor) or target.device.type != "cpu":
        return False
    if not target.is_contiguous() or target.storage_offset() != 0:
        return False
    n = target.numel()
    split = _splittable(node, args[1:], kwargs, target.dtype, n)
    if split is None:
        return False
    a, t = split
    pieces: list[tuple[int, int]] = []
    for lo, hi in ranges:
        lo, hi = _widen(lo, hi, n, t)
        if pieces and lo - pieces[-1][1] < SKIP_MIN:  # drawing a short gap costs less than skipping it
            pieces[-1] = (pieces[-1][0], max(hi, pieces[-1][1]))
        else:
            pieces.append((lo, hi))
    if sum(hi - lo for lo, hi in pieces) < MIN_ELEMENTS or pieces == [(0, n)]:
        return False
    state, at = rng[keys["gen"]].state, 0
    flat = target.view(-1)
    for lo, hi in pieces:
        gen = private_generator(RngSnapshot(device="cpu", state=mt19937.advance(state, a * (lo - at))))
        for first, last in chunk_bounds(hi - lo, bool(t)):  # cache-sized, as fill_in_chunks_exact (lo is 16-aligned)
            node.target(flat[lo + first:lo + last], *args[1:], **{**kwargs, "generator": gen})
        state, at = gen.get_state(), hi
    return True


def fills_pieces_exact(node: fx.Node) -> bool:
    """Whether ``fill_piece_exact`` can fill pieces of random ``node``'s target, decided
    from the graph alone (before anything runs): lets a caller know that asking for part
    of a tensor costs only that part."""
    target = node.args[0] if node.args else None
    spec = target.meta.get("spec") if isinstance(target, fx.Node) else None
    rest, kwargs = tuple(node.args[1:]), dict(node.kwargs)
    if set(node.meta.get("generators") or {}) != {"gen"} or spec is None or spec.device.type != "cpu":
        return False
    if spec.storage_offset != 0 or not torch.empty_strided(spec.shape, spec.stride, device="meta").is_contiguous():
        return False
    if any(isinstance(a, fx.Node) for a in (*rest, *kwargs.values())):
        return False
    return _splittable(node, rest, kwargs, spec.dtype, spec.numel) is not None


def fill_in_chunks_exact(node: fx.Node, rest: tuple, kwargs: dict, rng: Mapping[str, Snapshot],
                         dtype: torch.dtype, n: int,
                         sink: Callable[[int, int, torch.Tensor], None] | None = None,
                         out: torch.Tensor | None = None) -> bool:
    """Run in-place random ``node`` on a flat ``dtype`` tensor of ``n`` elements piece by
    piece; False when the sampler cannot be split exactly. Each piece is filled in a
    scratch buffer and handed to ``sink(lo, hi, piece)``, or filled in place in ``out``
    (flat, contiguous); with neither, only answers whether it can be done.

    One private generator runs on from piece to piece: every piece but the last is a
    multiple of 16 elements long, so each leaves the generator exactly ``a * len`` words
    further (the calibrated draw model with no fixed prefix), which is where the next
    piece of a whole fill starts (the probe of ``_piecewise_ok``). Pieces that fit in
    the cache also make two-pass samplers (``normal_``: uniforms, then Box-Muller) read
    their second pass from cache instead of memory.
    """
    keys = node.meta.get("generators") or {}
    split = _splittable(node, rest, kwargs, dtype, n) if set(keys) == {"gen"} else None
    if split is None:
        return False
    if sink is None and out is None:
        return True
    gen = private_generator(rng[keys["gen"]])
    scratch = torch.empty(CHUNK + 32, dtype=dtype) if out is None else None
    for lo, hi in chunk_bounds(n, bool(split[1])):
        piece = out[lo:hi] if scratch is None else scratch[:hi - lo]
        node.target(piece, *rest, **{**kwargs, "generator": gen})
        if sink is not None:
            sink(lo, hi, piece)
    return True


def fill_whole_in_chunks(node: fx.Node, args: tuple, kwargs: dict, rng: Mapping[str, Snapshot]) -> bool:
    """Run in-place random ``node`` on its whole (large, contiguous, CPU) target in
    cache-sized pieces, with the bits of one whole call; False (nothing done) otherwise."""
    target = args[0] if args else None
    if not isinstance(target, torch.Tensor) or target.device.type != "cpu" or not target.is_contiguous():
        return False
    n = target.numel()
    if n < 2 * CHUNK or any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
        return False
    return fill_in_chunks_exact(node, args[1:], kwargs, rng, target.dtype, n, out=target.view(-1))


def chunk_bounds(n: int, blocks: bool) -> list[tuple[int, int]]:
    """Pieces of ``CHUNK`` elements covering ``0 .. n``; with ``blocks`` (a sampler working
    in blocks of 16 that recomputes the last one), the last piece takes the tail block."""
    bounds, lo = [], 0
    while lo < n:
        lo, hi = _widen(lo, min(n, lo + CHUNK), n, 16 if blocks else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _splittable(node: fx.Node, rest: tuple, kwargs: dict, dtype: torch.dtype, n: int) -> tuple[int, int] | None:
    """``(words per element, tail block words)`` when pieces of this fill of ``n`` elements
    can be generated apart with the whole fill's bits: a calibrated draw model with no
    fixed prefix, and a probe on the installed torch that agrees; else None."""
    meta = torch.empty(n, dtype=dtype, device="meta")
    model = draw_model(node.target, (meta, *rest), kwargs, meta)
    if model is None:
        return None
    a, r, b, t = model
    if r != 1 or b != 0 or t not in (0, 16 * a) or not _piecewise_ok(node.target, dtype, rest, kwargs):
        return None
    return a, t


def _widen(lo: int, hi: int, n: int, tail: int) -> tuple[int, int]:
    """Samplers that work in blocks of 16 (normal_) need block-aligned pieces, and a piece
    reaching into the last, recomputed block must run to the end."""
    if not tail:
        return lo, hi
    lo -= lo % 16
    hi = min(n, -(-hi // 16) * 16)
    if n % 16 and hi > n - n % 16 - 16:
        hi = n
    return lo, hi


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
            lo, hi = _widen(lo, hi, _PROBE_N, t)
            piece = torch.empty(hi - lo, dtype=dtype)
            g = private_generator(RngSnapshot(device="cpu", state=mt19937.advance(state, a * lo)))
            func(piece, *rest, **{**kwargs, "generator": g})
            if not torch.equal(piece.view(torch.uint8 if dtype.itemsize == 1 else piece.dtype),
                               whole[lo:hi].view(torch.uint8 if dtype.itemsize == 1 else whole.dtype)):
                return False
        return True
    except Exception:
        return False
